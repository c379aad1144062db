"""The goodput account (trainapp/observe/goodput.py) over records made by hand: each cause where it belongs;
and end to end, one torchrun run through a killed rank, a hang and a SIGTERM preemption, resumed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import QUICK, REPO, at_step, exited, kill_registered, metrics, run_cmd, torchrun_cmd, wait_until

from trainapp.observe import goodput
from trainapp.tools import report


def _start(t, step, job, restart=0, resumed=None, launch=None):
    return {"kind": "start", "time": t, "step": step, "global_batch": 100, "restart": restart,
            "resumed_step": resumed,
            "startup": {"worker_process": launch if launch is not None else t - 2},
            "lease": {"holder": {"job": job}}}


def _train(t, step, sps=1000.0):  # 100 samples a step at 1000/s: 0.1 s a step
    return {"kind": "train", "time": t, "step": step, "samples_per_s": sps}


def test_a_hang_then_a_resubmission_later_are_detection_redone_and_time_between_attempts():
    records = [
        _start(100.0, 0, "alone:a"),                       # launched at 98: 2 s of start-up
        _train(101.0, 10), _train(102.0, 20),               # 20 steps, 0.1 s each, from 100.0 to 102.0
        {"kind": "snapshot", "time": 102.0, "step": 20, "blocking_s": 0.5},
        _train(103.5, 30),                                  # 10 more (1.0 s) after the 0.5 s snapshot
        # the watchdog: 20 s after the last step
        {"kind": "failure", "time": 123.5, "step": 30, "cause": "hang"},
        _start(200.0, 20, "alone:b", resumed=20, launch=195.0),  # a new job 71.5 s later
        _train(201.0, 30), _train(202.0, 40),
        {"kind": "end", "time": 202.0, "steps": 40},
    ]
    acc = goodput.account(records)
    bad = acc["badput_s"]
    assert acc["wall_s"] == pytest.approx(202.0 - 98.0)
    assert bad["startup"] == pytest.approx(2.0 + 5.0)
    assert bad["detection"] == pytest.approx(20.0)
    assert acc["steps_redone"] == 10 and bad["redone"] == pytest.approx(1.0)
    assert bad["snapshot"] == pytest.approx(0.5)
    assert bad["between_attempts"] == pytest.approx(195.0 - 123.5) and bad["restart"] == 0
    # steps 1-20 of the first attempt, 21-40 of the second
    assert acc["goodput_s"] == pytest.approx(2.0 + 2.0)
    assert abs(bad["other"]) < 1e-6
    assert goodput.table(acc)[0].startswith("goodput        3.8% of 104.0 s")


def test_the_same_jobs_restart_is_a_restart_and_a_notice_is_no_failure():
    records = [
        _start(10.0, 0, "torchrun:x"), _train(11.0, 10),
        # 2 steps after the record, then 0.2 s
        {"kind": "preempted", "time": 11.4, "step": 12, "signal": "SIGTERM"},
        _start(20.0, 12, "torchrun:x", resumed=12, launch=15.0),
        _train(21.0, 22), {"kind": "end", "time": 21.0},
    ]
    acc = goodput.account(records)
    bad = acc["badput_s"]
    assert acc["steps_redone"] == 0 and bad["restart"] == pytest.approx(15.0 - 11.4)
    assert bad["notice"] == pytest.approx(0.2) and bad["detection"] == 0
    assert [a["ended_by"] for a in acc["attempts"]] == ["notice", "end"]
    assert acc["goodput_s"] == pytest.approx(1.2 + 1.0)


HANG_TIMEOUT_S = 8.0
KILL_AT, HANG_AT, PREEMPT_AFTER, SNAPSHOT_EVERY = 13, 27, 35, 5
# Rank 1 is SIGKILLed after step 13 and hangs after step 27 (each drill fires once per run.dir: a marker
# file), both between two snapshots and two records (every 5 steps), so each restart redoes steps that
# only the failure record's step shows. 100 steps leave time to send the SIGTERM after step 35.
E2E_RUN = [*QUICK, "train.epochs=100", "train.max_steps=100", f"snapshot.every_steps={SNAPSHOT_EVERY}",
           f"fault.hang_timeout_s={HANG_TIMEOUT_S}", "drill.rank=1", f"drill.kill_at_step={KILL_AT}",
           f"drill.hang_at_step={HANG_AT}",
           "snapshot.memory_every_steps=0"]  # the steps the storage tier redoes


def _preempt_after(cmd: list[str], run_dir: Path, env: dict, tmp: Path, step: int) -> None:
    """Run `cmd` (torchrun, restarting on its own) until it has trained past `step`, then SIGTERM its
    whole process group, as a container runtime does."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    with open(tmp / "first.err", "w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
        try:
            wait_until(at_step(run_dir, "train", step), f"step {step}", 120,
                       gone=exited(proc, lambda: (err.seek(0), err.read())[1]))
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            kill_registered(Path(env["TRAINAPP_RUNTIME_DIR"]))
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _attempts(records: list[dict]) -> list[list[dict]]:
    out: list[list[dict]] = []
    for r in records:
        if r["kind"] == "start":
            out.append([])
        out[-1].append(r)
    return out


def _reached(attempt: list[dict]) -> int:
    """The last step an attempt trained: a killed rank writes nothing, but its peer's `peer` failure record,
    a hang's and a preemption's record carry the step, which the last `train` record (every
    train.log_every steps) may be short of."""
    return max(r["step"] for r in attempt if r["kind"] in ("train", "failure", "preempted"))


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_rank_a_hang_and_a_preemption_in_one_run_are_each_accounted_and_add_up_to_its_wall_time(
        tmp_path):
    run_dir, t0 = tmp_path / "run", time.monotonic()
    cmd = torchrun_cmd(2, f"run.dir={run_dir}", *E2E_RUN, max_restarts=2)
    env = {"TRAINAPP_RUNTIME_DIR": str(tmp_path / "rt")}
    _preempt_after(cmd, run_dir, env, tmp_path, PREEMPT_AFTER)
    r = run_cmd(cmd, timeout=120, env=env)  # the same command again: resumed where the SIGTERM stopped it
    assert r.returncode == 0, r.output[-3000:]
    elapsed, records = time.monotonic() - t0, metrics(run_dir)
    acc = goodput.account(records)
    bad = acc["badput_s"]
    # pytest shows it on a failure
    print(*goodput.table(acc), bad, f"test's elapsed {elapsed:.1f} s", sep="\n")

    attempts = _attempts(records)
    starts = [a[0] for a in attempts]
    assert [s["restart"] for s in starts] == [0, 1, 2, 0]  # two torchrun restarts, then a new torchrun
    assert [a["ended_by"] for a in acc["attempts"]] == ["failure", "failure", "notice", "end"]
    reached = [_reached(a) for a in attempts]
    assert reached[:2] == [KILL_AT, HANG_AT], reached
    redone = [reached[i] - starts[i + 1]["resumed_step"] for i in range(3)]
    # Each restart resumes from the periodic snapshot before its drill; the preemption's own snapshot loses
    # nothing.
    assert redone == [KILL_AT % SNAPSHOT_EVERY, HANG_AT % SNAPSHOT_EVERY, 0], (redone, starts)
    assert acc["steps_redone"] == sum(redone) and bad["redone"] > 0

    total = acc["goodput_s"] + sum(bad.values())
    assert abs(total - acc["wall_s"]) <= 0.02  # by construction (each cause rounded to 1 ms)
    assert abs(bad["other"]) <= 0.02 * acc["wall_s"], acc
    launch = min(starts[0]["startup"].values())
    assert acc["wall_s"] == pytest.approx(records[-1]["time"] - launch, abs=1e-3) and acc["wall_s"] < elapsed
    assert bad["restart"] > 0 and bad["between_attempts"] > 0

    # Detection is summed over both failed attempts: the kill's share, from the drill's own timestamp to
    # the peer's record, is small; what is left is the hang's, its watchdog timeout.
    killed = float((run_dir / f"fault-fired-step{KILL_AT}-rank1").read_text())
    hung = float((run_dir / f"fault-fired-hang-step{HANG_AT}-rank1").read_text())
    kill_share = min(r["time"] for r in attempts[0] if r["kind"] == "failure") - killed
    hang_share = min(r["time"] for r in attempts[1] if r["kind"] == "failure") - hung
    assert 0 <= kill_share < 2, kill_share
    assert HANG_TIMEOUT_S - 1 <= hang_share <= HANG_TIMEOUT_S + 3, hang_share
    assert bad["detection"] == pytest.approx(kill_share + hang_share, abs=0.5), (bad, kill_share, hang_share)

    assert 0 < acc["goodput"] < 1
    end = records[-1]
    assert end["kind"] == "end" and end["goodput"] == pytest.approx(acc["goodput"], abs=0.005), (end, acc)
    assert (end["steps_redone"] == acc["steps_redone"]
            and end["wall_s"] == pytest.approx(acc["wall_s"], abs=0.5))
    assert all(line in report.summarize(run_dir, records) for line in goodput.table(acc))


def test_an_uneven_split_is_no_straggler_but_a_slow_rank_still_is():
    def ranks(busy):
        return {"kind": "ranks", "time": 0.0, "step": 10,
                "ranks": [{"rank": r, "steps": 10, "busy_ms": b, "phase_ms": {"data": 0.0}}
                          for r, b in enumerate(busy)]}

    uneven = {"kind": "start", "layout": {"micro_steps": [2, 1]}}
    # Rank 0 runs two micro-batches of 50 ms, rank 1 one: the 50 ms rank 1 waits is the split's.
    assert goodput._waits(uneven, [ranks([100.0, 50.0])])[1] == pytest.approx(0.0)
    # Rank 1 takes 80 ms for its one: rank 0's pace (50 ms a micro-batch) sets the floor, 100 ms a step.
    assert goodput._waits(uneven, [ranks([100.0, 80.0])])[1] == pytest.approx(0.0)
    # Rank 0 at 70 ms a micro-batch against rank 1's 50: 140 - 2 * 50 = 40 ms a step, 10 steps.
    assert goodput._waits(uneven, [ranks([140.0, 50.0])])[1] == pytest.approx(0.4)
    # An even split (no layout in the record: older runs) is the slowest's own work beyond the fastest's.
    assert goodput._waits({"kind": "start"}, [ranks([100.0, 60.0])])[1] == pytest.approx(0.4)


def test_a_slurm_requeue_keeps_its_job_id_but_its_queue_wait_is_time_between_attempts():
    def start(t, step, requeue, restart=0):
        r = _start(t, step, "slurm:42", restart=restart, resumed=step or None)
        r["lease"]["holder"]["requeue"] = requeue
        return r

    records = [start(10.0, 0, 0), _train(11.0, 10),
               {"kind": "failure", "time": 11.5, "step": 10, "cause": "peer"},
               start(14.0, 10, 0, restart=1), _train(15.0, 20),  # torchrun's restart inside the allocation
               {"kind": "preempted", "time": 15.2, "step": 20, "signal": "SIGTERM"},
               # requeued, 82.8 s later
               start(100.0, 20, 1), _train(101.0, 30), {"kind": "end", "time": 101.0}]
    bad = goodput.account(records)["badput_s"]
    assert bad["restart"] == pytest.approx(12.0 - 11.5)
    assert bad["between_attempts"] == pytest.approx(98.0 - 15.2)
