"""Every failure explained: `failure` records from the rank that failed and from its peers, the
peers out within seconds (real processes, a real store, a real Gloo collective), the out-of-memory
drill under torchrun, `trainapp report` listing it all; the GPU memory summary on a mocked allocator
(the one part this machine cannot have)."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import PY, QUICK, REPO, metrics, run_cmd, torchrun_cmd, trainapp, wait_until

from trainapp.errors import PEER_EXIT, ConfigError
from trainapp.faults import failure
from trainapp.faults.heartbeat import PEER_FIRST_S, PEER_WAIT_PHASES, Heartbeat, Watchdog
from trainapp.faults.preempt import Preempted
from helpers import free_port
from trainapp.snapshots.manager import StorageError

# Two ranks of a plain launch (RANK/WORLD_SIZE/MASTER_ADDR, no torchrun to end the survivor): rank 0
# hosts the store. MODE raise: rank 1 fails and stays alive (its sockets open, like a process stuck in
# its teardown), rank 0 waits in a real all-reduce rank 1 never joins. MODE store: both wait in a call
# that cannot see a dead peer (as an NCCL collective cannot), and the test SIGKILLs rank 0.
RANKS = """
import sys, time, torch, torch.distributed
from trainapp.faults.guard import RankGuard
from trainapp.config import DistSection
from trainapp.launch import dist
mode, run_dir = sys.argv[1], sys.argv[2]
ctx = dist.setup(DistSection(timeout_s=60))
try:
    with RankGuard().failures.watching(run_dir, ctx, lambda: dist.side_store(ctx)):
        print("ready", flush=True)
        if mode == "raise" and ctx.rank == 1:
            raise RuntimeError("boom in rank 1")
        if mode == "raise":
            torch.distributed.all_reduce(torch.zeros(1))
        time.sleep(120)
except RuntimeError:
    time.sleep(120)
"""


def _start_ranks(mode: str, run_dir: Path) -> list[subprocess.Popen]:
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return [subprocess.Popen([PY, "-c", RANKS, mode, str(run_dir)], cwd=REPO, env={**env, "RANK": str(rank)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
            for rank in (0, 1)]


def _wait_exit(proc: subprocess.Popen, timeout: float) -> tuple[int | None, float]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, time.time()
    return proc.returncode, time.time()


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.communicate()


@pytest.mark.slow
def test_a_peer_blocked_in_a_collective_with_a_failed_rank_exits_within_seconds(tmp_path):
    procs = _start_ranks("raise", tmp_path)
    try:
        code, at = _wait_exit(procs[0], timeout=60)
        assert code == PEER_EXIT, procs[0].communicate(timeout=5)
        assert procs[1].poll() is None  # the failed rank is still alive: only the watch ended rank 0
        failed, peer = sorted(metrics(tmp_path, "failure"), key=lambda r: r["rank"], reverse=True)
        assert ((failed["rank"], failed["cause"], failed["error"])
                == (1, "exception", "RuntimeError: boom in rank 1"))
        assert peer["rank"] == 0 and peer["cause"] == "peer" and "rank 1 on" in peer["error"], peer
        assert "boom in rank 1" in peer["error"]
        assert at - failed["time"] < 10, at - failed["time"]
        err = procs[0].communicate(timeout=5)[1]
        assert ("trainapp: rank 0 on" in err
                and "failed after step 0 in phase start: peer: rank 1 on" in err), err
    finally:
        _kill(procs)


@pytest.mark.slow
def test_the_ranks_exit_within_seconds_when_the_stores_host_dies(tmp_path):
    procs = _start_ranks("store", tmp_path)
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        os.kill(procs[0].pid, signal.SIGKILL)
        killed = time.time()
        code, at = _wait_exit(procs[1], timeout=60)
        assert code == PEER_EXIT and at - killed < 10, (code, at - killed)
        [peer] = metrics(tmp_path, "failure")
        assert (peer["rank"] == 1 and peer["cause"] == "peer"
                and "store stopped answering" in peer["error"]), peer
    finally:
        _kill(procs)


@pytest.mark.slow
def test_out_of_memory_drill_under_torchrun_is_explained_and_the_restart_finishes(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cmd(torchrun_cmd(2, f"run.dir={run_dir}", *QUICK, "train.epochs=100", "train.max_steps=30",
                             "snapshot.every_steps=10", "snapshot.memory_every_steps=0",
                             "drill.oom_at_step=15", "drill.rank=1",
                             max_restarts=1))
    assert r.returncode == 0, r.output[-3000:]
    oom, peer = metrics(run_dir, "failure")
    assert ((oom["rank"], oom["cause"], oom["step"], oom["phase"], oom["attempt"])
            == (1, "oom", 15, "compute", 0))
    assert oom["error"].startswith("OutOfMemoryError: fault drill (drill.oom_at_step=15)"), oom
    assert oom["memory"]["device"] == "cpu" and oom["memory"]["peak_rss_mb"] > 50, oom
    assert oom["host"] == os.uname().nodename and oom["exit_code"] == 1
    assert ((peer["rank"], peer["cause"]) == (0, "peer") and "rank 1 on" in peer["error"]
            and "oom" in peer["error"])
    assert peer["time"] - oom["time"] < 10
    assert "trainapp: rank 1 on" in r.stderr
    assert "failed after step 15 in phase compute: oom: OutOfMemoryError" in r.stderr
    starts = metrics(run_dir, "start")
    assert [s["resumed_step"] for s in starts] == [None, 10] and metrics(run_dir, "end")[0]["steps"] == 30
    rep = trainapp("report", str(run_dir), timeout=120)
    assert rep.returncode == 0, rep.output
    assert ("failures       1\n  attempt 0: rank 1 on" in rep.stdout
            and "oom: OutOfMemoryError" in rep.stdout), rep.stdout
    assert "then rank 0 peer" in rep.stdout


def test_cuda_out_of_memory_records_the_allocators_peak_and_summary(monkeypatch):
    import torch
    import torch.cuda.memory as cuda_memory

    gib = 2 ** 30
    stats = collections.defaultdict(int, {"allocated_bytes.all.peak": 7 * gib,
                                          "allocated_bytes.all.current": 6 * gib,
                                          "reserved_bytes.all.current": 8 * gib, "num_ooms": 1,
                                          "num_alloc_retries": 2, "num_sync_all_streams": 0,
                                          "num_device_alloc": 3, "num_device_free": 0})
    monkeypatch.setattr(cuda_memory, "memory_stats", lambda device=None: stats)  # the real summary's input
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 7 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 8 * gib)

    def broken(d):  # a call that fails after the OOM must not lose the rest
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    mem = failure.memory(torch.device("cuda", 0))
    assert mem["device"] == "cuda:0"
    assert (mem["peak_allocated_mb"], mem["allocated_mb"], mem["reserved_mb"]) == (7168.0, 6144.0, 8192.0)
    assert "free_mb" not in mem
    rows = mem["summary"]
    assert rows[0].startswith("CUDA OOMs: 1") and rows[1].startswith("Metric | Cur Usage | Peak Usage")
    assert "Allocated memory | 6144 MiB | 7168 MiB | 0 B | 0 B" in rows and len(rows) == 9, rows


def test_which_endings_are_failures():
    explain = failure.FailureLog(Heartbeat(), leave=lambda code: None).explain
    assert explain(ConfigError("x=1: bad")) is None
    assert explain(Preempted(15, 10, 1.0, "/s", 0)) is None
    assert explain(KeyboardInterrupt()) is None
    cause, error, _ = explain(StorageError("snapshot.max_failures=3: ..."))
    assert (cause, StorageError.everywhere) == ("storage", True)
    cause, error, extra = explain(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed "
                                               "by peer [127.0.0.1]:4242"))
    assert cause == "peer" and "died without a word" in error and extra == {"peer": "unknown"}
    assert explain(ValueError("bad batch\nmore")) == ("exception", "ValueError: bad batch", {})


def test_every_rank_agrees_on_a_fresh_attempt_name_over_a_store_holding_a_dead_attempts_keys():
    """torchrun's agents count restarts differently across nodes (a healthy agent restarts its workers
    without counting), so the attempt's store prefix is agreed through the store itself (a real
    TCPStore here, ranks as threads): a second attempt over the first one's leftover keys gets a new
    name on every rank, and a rank that never comes is named once dist.timeout_s runs out."""
    import datetime
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as tdist

    from trainapp.launch import dist

    port, timeout = free_port(), datetime.timedelta(seconds=20)
    server = tdist.TCPStore("127.0.0.1", port, is_master=True, timeout=timeout, wait_for_workers=False)

    def attempt(ranks: list[int], world: int = 3, t=timeout) -> list[str]:
        def one(rank: int) -> str:
            store = tdist.PrefixStore("rounds", tdist.TCPStore("127.0.0.1", port, is_master=False, timeout=t))
            return dist._agree_on_round(store, rank, world, t)
        with ThreadPoolExecutor(len(ranks)) as pool:
            return list(pool.map(one, ranks))

    first = attempt([0, 1, 2])
    assert len(set(first)) == 1
    second = attempt([2, 1, 0])  # the non-zero ranks first: the dead attempt's hellos are still there
    assert len(set(second)) == 1 and second[0] != first[0]
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[2\] did not join"):
        attempt([0, 1], t=datetime.timedelta(seconds=2))
    del server


def test_a_rank_waiting_on_its_peers_gives_the_hung_rank_the_first_word(tmp_path):
    """A silent rank in a phase that waits on its peers (a collective) records a hang only PEER_FIRST_S
    after one whose own work stopped would, so that the rank that hangs is on record first (under Ray
    Train the controller stops the group once one worker exited)."""
    heartbeat = Heartbeat()
    dog = Watchdog(heartbeat, 0.4, 0.4, tmp_path / "stacks.txt", rank=1, fire=lambda silent: None)
    dog.start().stop()
    heartbeat.step += 1  # past the first step: the run's timeout, not the start-up's
    for phase, allowance in (("data", 0.4), *((p, 0.4 + PEER_FIRST_S) for p in PEER_WAIT_PHASES),
                             ("snapshot", None)):  # rank 1 waits for rank 0's write, which rank 0 watches
        heartbeat.set_phase(phase)
        assert dog._allowance() == allowance, phase
    fired: list[float] = []
    heartbeat.set_phase("compute")
    dog = Watchdog(heartbeat, 0.4, 0.4, tmp_path / "stacks.txt", rank=1, fire=fired.append).start()
    heartbeat.step += 1
    try:
        wait_until(lambda: fired, "the watchdog's fire", timeout=30)
    finally:
        dog.stop()
    assert fired[0] > 0.4 + PEER_FIRST_S, fired
