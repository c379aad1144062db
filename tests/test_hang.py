"""The hung-rank watchdog with real hangs: the `drill.hang_at_step` drill (a rank's training thread
stops making progress) and an external SIGSTOP, under torchrun with a restart; and no false alarm from a
long eval, a slow snapshot write or the first step."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (FAULT_RUN, PY, QUICK, REPO, inspect, kill_registered, metrics, run_cmd, torchrun2,
                     torchrun_cmd, wait_for_record, wait_until)

from trainapp.faults.heartbeat import PEER_FIRST_S

pytestmark = pytest.mark.slow

RUN = [*QUICK, "train.epochs=100", "train.max_steps=60", "snapshot.every_steps=10"]


def torchrun(run_dir: Path, *args: str, restarts: int = 1) -> list[str]:
    return torchrun_cmd(2, f"run.dir={run_dir}", *RUN, *args, max_restarts=restarts)


def test_a_hung_rank_is_found_by_both_ranks_and_the_restart_resumes_bitwise(torchrun_straight, tmp_path):
    """FAULT_RUN (accumulation, EMA, evaluation), rank 1 hung after step 13: its twin is the shared
    straight run."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    r = run_cmd(torchrun2(run_dir, *FAULT_RUN, "drill.hang_at_step=13", "drill.rank=1",
                          "fault.hang_timeout_s=5"))
    assert r.returncode == 0, r.output[-3000:]
    assert time.monotonic() - t0 < 120
    hung = (run_dir / "hangs" / "rank-1-attempt-0.txt").read_text()
    assert "rank 1 on" in hung and "after step 13 in phase data: hang: no progress" in hung, hung[:2000]
    # the hung thread's own stack (the drill's) is in the dump
    assert "Thread 0x" in hung and "in after_step" in hung
    # Rank 0 waits for rank 1 in the all-reduce: its own watchdog finds that, or rank 1's word reaches it
    # first.
    failures = {f["rank"]: f for f in metrics(run_dir, "failure")}
    assert failures[1]["cause"] == "hang" and failures[1]["phase"] == "data" and failures[1]["step"] == 13
    # Rank 0 is blocked in the gradient all-reduce of the next step's last micro-batch: the phase clock's
    # compute.
    assert failures[0]["cause"] in ("hang", "peer") and failures[0]["phase"] == "compute", failures[0]
    blocked = run_dir / "hangs" / "rank-0-attempt-0.txt"
    assert failures[0]["cause"] == "peer" or "after step 13 in phase compute" in blocked.read_text()
    assert "exitcode: 124" in r.stderr or "exitcode  : 124" in r.stderr, r.stderr[-3000:]
    starts = metrics(run_dir, "start")
    assert [s["resumed_step"] for s in starts] == [None, 10]
    assert inspect(run_dir)["params_sha256"] == inspect(torchrun_straight)["params_sha256"]


@pytest.mark.e2e
def test_a_sigstopped_rank_is_found_by_its_peer_in_seconds(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINAPP_RUNTIME_DIR": str(tmp_path / "rt")}
    proc = subprocess.Popen(torchrun(run_dir, "fault.hang_timeout_s=5", "train.max_steps=100"), cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for_record(run_dir, "train", lambda r: r["step"] >= 25, timeout=120)
        os.kill(worker_pids(tmp_path / "rt")[1], signal.SIGSTOP)
        stopped = time.time()
        _, err = proc.communicate(timeout=240)
    finally:
        kill_registered(tmp_path / "rt")
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-3000:]
    line = (run_dir / "hangs" / "rank-0-attempt-0.txt").read_text().splitlines()[0]
    assert "rank 0 on" in line and "in phase compute" in line, line
    resumed = metrics(run_dir, "start")[-1]
    # 5 s to find it, torchrun's 30 s wait before it SIGKILLs the stopped rank (its restart path ignores
    # --shutdown-timeout in torch 2.14), the restart: within the 100 s at the default 60 s
    assert resumed["resumed_step"] is not None and resumed["time"] - stopped < 60, resumed["time"] - stopped
    assert inspect(run_dir)["global_step"] == 100


def worker_pids(runtime_root: Path) -> dict[int, int]:
    """{rank: pid} of the torchrun workers registered under `runtime_root` (TRAINAPP_RUNTIME_DIR)."""
    return {int((Path(f"/proc/{p.name}/environ").read_bytes().split(b"RANK=", 1)[1]
                 .split(b"\0")[0])): int(p.name)
            for p in (runtime_root / "workers").iterdir()}


@pytest.mark.e2e
def test_a_sigstopped_rank_of_an_fsdp_run_is_found_by_its_peer_within_the_hang_timeout(tmp_path):
    """Under FSDP rank 0 waits for the stopped rank 1 in a unit's all-gather or reduce-scatter, inside the
    forward or backward (`compute`), or in the gradient norm's all-reduce of `train.grad_clip` (`optim`),
    wherever in its step rank 1 was stopped: its watchdog fires, it records the hang and exits 124."""
    run_dir, rt = tmp_path / "run", tmp_path / "rt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINAPP_RUNTIME_DIR": str(rt)}
    proc = subprocess.Popen(torchrun(run_dir, "parallel.strategy=fsdp", "fault.hang_timeout_s=5", restarts=0),
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for_record(run_dir, "train", lambda r: r["step"] >= 15, timeout=120)
        pids = worker_pids(rt)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.time()
        rec = wait_for_record(run_dir, "failure", lambda r: r["rank"] == 0, timeout=60)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not _alive(pids[0]), "rank 0's exit", 10, interval=0.1)
        alive = _alive(pids[0])
    finally:
        kill_registered(rt)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # 5 s of silence, the 2 s a rank waiting on its peers gives the hung one to speak first, the watchdog's
    # poll of 1 s, the record: a few seconds over the timeout
    assert rec["cause"] == "hang" and rec["exit_code"] == 124 and rec["phase"] in ("compute", "optim"), rec
    assert rec["time"] - stopped < 5 + PEER_FIRST_S + 4, rec["time"] - stopped
    assert not alive  # the peer left: torchrun sees its exit 124 and tears the group down
    hung = (run_dir / "hangs" / "rank-0-attempt-0.txt").read_text()
    assert "rank 0 on" in hung and f"in phase {rec['phase']}: hang: no progress" in hung, hung[:2000]


@pytest.mark.e2e
def test_a_shard_write_slower_than_the_hang_timeout_is_no_hang_but_a_rank_stopped_inside_one_is_found(
        tmp_path):
    """FSDP: every rank's shards take 5 s to write (the drill's slow disk) against fault.hang_timeout_s=2.
    The step-10 snapshot completes, no watchdog fires; rank 1 SIGSTOPped inside the step-20 write stops
    its shard growing, and rank 0, once its own shard is written, is found silent in the snapshot phase."""
    run_dir, rt = tmp_path / "run", tmp_path / "rt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINAPP_RUNTIME_DIR": str(rt)}
    cmd = torchrun(run_dir, "parallel.strategy=fsdp", "fault.hang_timeout_s=2",
                   "drill.snapshot_write_delay_s=5", "train.max_steps=30", restarts=0)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        snap = wait_for_record(run_dir, "snapshot", lambda r: r["step"] == 10, timeout=120)
        with contextlib.suppress(AssertionError):  # SIGSTOP as late as that, or now
            wait_until(lambda: list((run_dir / "snapshots").glob(".tmp-step_000000020-*/shards/__1_*")),
                       "rank 1's shard of step 20 begun", 60)
        os.kill(worker_pids(rt)[1], signal.SIGSTOP)
        stopped = time.time()
        rec = wait_for_record(run_dir, "failure", lambda r: r["rank"] == 0, timeout=60)
    finally:
        kill_registered(rt)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert snap["blocking_s"] > 2 + 2, snap  # the write was well over the timeout, and no one fired
    meta = json.loads((run_dir / "snapshots" / "step_000000010" / "meta.json").read_text())
    assert {"shards/__0_0.distcp", "shards/__1_0.distcp"} <= set(meta["shards"]), meta
    assert rec["cause"] == "hang" and rec["phase"] == "snapshot" and rec["step"] == 20, rec
    # rank 0's own 5 s write goes on after the stop, then 2 s of silence and the watchdog's poll
    assert rec["time"] - stopped < 5 + 2 + 4, rec["time"] - stopped


def _alive(pid: int) -> bool:
    """The process runs (not gone, not a zombie its parent has yet to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.e2e
@pytest.mark.parametrize("nproc", [1, 2])
def test_no_false_alarm_from_a_long_eval_or_a_slow_snapshot_write(tmp_path, nproc):
    run_dir = tmp_path / "run"
    # hang_timeout_s=2 against an eval of a 40000-image validation set (seconds) and snapshot writes
    # held 4 s by the drill: neither may fire; the other ranks wait out rank 0's write. Alone the
    # writes are asynchronous: the end of the run waits for the last one, which progresses meanwhile.
    # Two ranks evaluate the run's small validation set: a rank that ends its share of an eval first waits
    # for the other in the gather of the results, silent, and beside a second lane the other's 20000
    # images once came more than 2 s later (the watchdog counts that wait, as any collective's).
    val = 40000 if nproc == 1 else 256
    args = ["fault.hang_timeout_s=2", f"data.val_size={val}", "train.eval_every=30",
            "drill.snapshot_write_delay_s=4", "snapshot.every_steps=30"]
    if nproc == 1:
        r = run_cmd([PY, "-m", "trainapp", "train", f"run.dir={run_dir}", *RUN, *args, "snapshot.async=true"])
    else:
        r = run_cmd(torchrun(run_dir, *args, restarts=0))
    assert r.returncode == 0, r.output[-3000:]
    assert not (run_dir / "hangs").exists()
    evals = metrics(run_dir, "eval")
    assert len(evals) == 2 and all(e["val_count"] == val for e in evals)
    assert [s["step"] for s in metrics(run_dir, "snapshot")] == [30, 60]


@pytest.mark.e2e
def test_a_background_snapshot_write_does_not_hide_a_hung_training_thread(tmp_path):
    """The writer of an asynchronous snapshot makes progress for 30 s while the training thread hangs
    one step later: the watchdog counts only the training thread, and fires after its 3 s."""
    run_dir = tmp_path / "run"
    r = run_cmd([PY, "-m", "trainapp", "train", f"run.dir={run_dir}", *RUN, "snapshot.async=true",
                 "drill.snapshot_write_delay_s=30", "drill.hang_at_step=11", "drill.rank=0",
                 "fault.hang_timeout_s=3"])
    assert r.returncode == 124, r.output[-3000:]
    hung_at = float((run_dir / "fault-fired-hang-step11-rank0").read_text().split()[0])
    (rec,) = metrics(run_dir, "failure")
    assert rec["cause"] == "hang" and rec["step"] == 11 and rec["phase"] == "data", rec
    assert rec["time"] - hung_at < 10, rec["time"] - hung_at  # not after the 30 s write
