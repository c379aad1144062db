"""Preemption notices with real signals to real processes: alone, under torchrun, through `trainapp
drain` and `trainapp node`. Each run is stopped between two periodic snapshots; the rerun must start at
the step reached (zero steps redone) and end bitwise equal to a run that was never stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (PY, REPO, TORCHRUN, exited, inspect, kill_registered, metrics, run_cmd, torchrun2,
                     wait_for_step, wait_until)

import trainapp
from trainapp.faults import drain

slow = pytest.mark.slow  # the process-level tests; the registry tests below are fast
PACKAGE = Path(trainapp.__file__).resolve().parent

# Long enough to be stopped in the middle (a few seconds), a periodic snapshot every 100 steps.
RUN = ["train.progress=false", "train.log_every=5", "data.train_size=1024", "data.val_size=256",
       "train.epochs=100", "train.max_steps=200", "snapshot.every_steps=100"]


class Job:
    """A training process group in its own session, output to files, killed by group at the end."""

    def __init__(self, cmd: list[str], tmp: Path, name: str):
        self.tmp, self.name = tmp, name
        self.runtime = tmp / f"rt-{name}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "TRAINAPP_RUNTIME_DIR": str(self.runtime)}
        self.out, self.err = open(tmp / f"{name}.out", "w+"), open(tmp / f"{name}.err", "w+")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.out, stderr=self.err,
                                     start_new_session=True)

    def workers(self, n: int, timeout: float = 120) -> dict[int, int]:
        """{rank: pid} of the `n` training processes, from the worker registry."""
        d = self.runtime / "workers"

        def registered() -> list[int] | None:
            pids = [int(p.name) for p in d.iterdir()] if d.is_dir() else []
            return pids if len(pids) == n else None

        pids = wait_until(registered, f"{n} workers registered in {self.runtime}", timeout)
        ranks = {}
        for pid in pids:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ranks[next((int(e[5:]) for e in env if e.startswith(b"RANK=")), 0)] = pid
        return ranks

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def signal_after(self, run_dir: Path, kind: str, step: int, pid: int | None, signum: int = signal.SIGTERM,
                     delay_s: float = 0.0) -> int:
        """Once metrics.jsonl has a `kind` record at `step` or later (and `delay_s` more), send `signum` to
        `pid` (None: the whole process group, as a container runtime does); the exit code, which came
        within the grace period."""
        self.reached(run_dir, kind, step)
        time.sleep(delay_s)
        t0 = time.monotonic()
        if pid is None:
            os.killpg(self.proc.pid, signum)
        else:
            os.kill(pid, signum)
        rc = self.wait()
        assert time.monotonic() - t0 < 25
        return rc

    def reached(self, run_dir: Path, kind: str, step: int, timeout: float = 120) -> None:
        """Once metrics.jsonl has a `kind` record at `step` or later; fails at once if the job ended first."""
        wait_for_step(run_dir, step, timeout, kind, gone=exited(self.proc, lambda: self.output()[1]))

    def kill(self) -> None:
        kill_registered(self.runtime)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def output(self) -> tuple[str, str]:
        self.out.seek(0)
        self.err.seek(0)
        return self.out.read(), self.err.read()


def trainapp_cmd(run_dir: Path, *args: str) -> list[str]:
    return [PY, "-m", "trainapp", "train", f"run.dir={run_dir}", *RUN, *args]


def preempt_torchrun_cmd(run_dir: Path, *args: str) -> list[str]:
    """RUN under torchrun: 2 ranks on RUN_DIR, no restart (a group a test stopped stays stopped)."""
    return torchrun2(run_dir, *RUN, *args, max_restarts=0)


def check_preempted(run_dir: Path, job: Job, rc: int | None, signum: int = signal.SIGTERM,
                    grace_s: float = 25) -> dict:
    """The stop: exit 128+sig (`rc` None: a launcher's own exit, checked by the caller), one `preempted`
    record whose snapshot is the newest valid one, no traceback from trainapp, within the grace period."""
    out, err = job.output()
    assert rc is None or rc == 128 + signum, f"exit {rc}\n{out[-2000:]}\n{err[-3000:]}"
    (rec,) = metrics(run_dir, "preempted")
    assert rec["signal"] == signal.Signals(signum).name and 0 <= rec["seconds"] < grace_s, rec
    snap = inspect(run_dir)  # the newest valid snapshot
    assert snap["global_step"] == rec["step"] and Path(snap["path"]).name == f"step_{rec['step']:09d}"
    every = metrics(run_dir, "start")[-1]["config"]["snapshot"]["every_steps"]
    assert rec["step"] % every, "stopped exactly at a periodic snapshot: the test proves nothing"
    trained = max(r["step"] for r in metrics(run_dir, "train"))
    assert rec["step"] >= trained, (rec, trained)  # the snapshot holds every step trained
    assert f"trainapp: preempted ({signal.Signals(signum).name}) at step {rec['step']}" in out, out[-2000:]
    for tb in err.split("Traceback")[1:]:  # torchrun's own SignalException may print one; never trainapp's
        # The package's own files, not any path that holds "trainapp" (a checkout at ~/trainapp has its venv
        # there).
        assert f'File "{PACKAGE}/' not in tb.split("\n\n", 1)[0], err[-3000:]
    return rec


def rerun_resumes_exactly(run_dir: Path, cmd, stop_step: int, twin_sha: str, *args: str) -> None:
    """The rerun of `cmd` after a stop at `stop_step` starts there and ends with the parameters `twin_sha`
    of the run never stopped (conftest.py's `straight_sha`)."""
    r = run_cmd(cmd(run_dir, *args), timeout=300)
    assert r.returncode == 0, r.output[-3000:]
    start = metrics(run_dir, "start")[-1]
    assert start["resumed_step"] == stop_step and start["step"] == stop_step  # zero steps redone
    final, end = inspect(run_dir), start["config"]["train"]["max_steps"]
    assert final["global_step"] == end and final["params_sha256"] == twin_sha


@slow
def test_sigterm_alone_snapshots_the_step_reached_and_the_rerun_is_bitwise_equal(tmp_path, straight_sha):
    run_dir = tmp_path / "run"
    job = Job(trainapp_cmd(run_dir), tmp_path, "alone")
    rc = job.signal_after(run_dir, "train", 120, job.proc.pid)
    rec = check_preempted(run_dir, job, rc)
    assert rec["phase"] in ("data", "compute", "optim", "other")  # the phase clock's, inside a step
    rerun_resumes_exactly(run_dir, trainapp_cmd, rec["step"], straight_sha(trainapp_cmd))


@pytest.mark.e2e
@slow
def test_sigterm_to_the_torchrun_process_group_stops_every_rank_at_one_step(tmp_path, straight_sha):
    """What a container runtime does: the signal reaches torchrun's agent and both workers; the agent
    forwards it again (a second notice, ignored)."""
    run_dir = tmp_path / "run"
    job = Job(preempt_torchrun_cmd(run_dir), tmp_path, "group")
    rc = job.signal_after(run_dir, "train", 120, None)
    out, err = job.output()
    assert rc != 0  # torchrun's own exit: its agent raises SignalException (documented)
    assert "forcefully exiting via 9" not in err, err[-3000:]  # no worker needed torchrun's SIGKILL
    assert "[rank 1] WARNING trainapp: preempted at step" in err and "exit 143" in err, err[-3000:]
    rec = check_preempted(run_dir, job, None)
    rerun_resumes_exactly(run_dir, preempt_torchrun_cmd, rec["step"], straight_sha(preempt_torchrun_cmd))


@slow
def test_sigterm_to_one_torchrun_worker_stops_both_at_the_same_step(tmp_path):
    run_dir = tmp_path / "run"
    job = Job(preempt_torchrun_cmd(run_dir), tmp_path, "one")
    ranks = job.workers(2)
    # rank 0, which writes, hears of it only through the vote
    rc = job.signal_after(run_dir, "train", 120, ranks[1])
    out, err = job.output()
    assert "exitcode: 143" in err and "forcefully exiting" not in err, err[-3000:]
    assert rc == 1  # torchrun reports failed workers with 1; their own codes are in its summary
    rec = check_preempted(run_dir, job, None)
    assert "[rank 1] WARNING trainapp: preempted at step %d" % rec["step"] in err, err[-3000:]


@pytest.mark.e2e
@slow
def test_second_signal_during_an_async_write_and_during_the_stop_keeps_every_snapshot_valid(tmp_path,
                                                                                            straight_sha):
    """The notice lands while the periodic step-100 snapshot is still being written in the background
    (the drill slows every write by 2 s); a second signal lands while the stop's own snapshot is written."""
    args = ("snapshot.async=true", "drill.snapshot_write_delay_s=2")
    run_dir = tmp_path / "run"
    job = Job(trainapp_cmd(run_dir, *args), tmp_path, "async")
    job.reached(run_dir, "snapshot", 100)  # recorded when the copy is done; the write goes on
    os.kill(job.proc.pid, signal.SIGTERM)
    time.sleep(1.0)
    os.kill(job.proc.pid, signal.SIGINT)
    rc = job.wait()
    rec = check_preempted(run_dir, job, rc)
    assert rec["step"] > 100 and rec["seconds"] >= 2, rec
    assert "SIGINT again; already stopping" in job.output()[1]
    assert inspect(run_dir / "snapshots" / "step_000000100")["global_step"] == 100
    # Asynchronous and slowed writes change nothing in the math (tests/test_async_snapshot.py): the
    # straight run without them is the reference.
    rerun_resumes_exactly(run_dir, trainapp_cmd, rec["step"], straight_sha(trainapp_cmd), *args)


@slow
def test_a_signal_during_eval_cuts_the_eval_short_and_snapshots_after_the_next_step(tmp_path):
    run_dir = tmp_path / "run"
    # A validation set large enough that evaluating it takes seconds, after the train record at step 60.
    job = Job(trainapp_cmd(run_dir, "data.val_size=60000", "train.eval_every=60", "train.log_every=60"),
              tmp_path, "eval")
    # Half a second into the eval, which takes seconds: not in the instant between the record and the eval.
    rc = job.signal_after(run_dir, "train", 60, job.proc.pid, delay_s=0.5)
    rec = check_preempted(run_dir, job, rc)
    assert rec["phase"] == "eval" and rec["step"] > 60, rec
    assert not metrics(run_dir, "eval")  # a partial eval is not recorded
    assert "cut short by a preemption notice" in job.output()[1]


@pytest.mark.e2e
@slow
def test_an_extra_signal_from_preempt_signals_is_a_notice_too(tmp_path):
    run_dir = tmp_path / "run"
    job = Job(trainapp_cmd(run_dir, "preempt.signals=[SIGUSR1]"), tmp_path, "usr1")
    rc = job.signal_after(run_dir, "train", 60, job.proc.pid, signal.SIGUSR1)
    rec = check_preempted(run_dir, job, rc, signal.SIGUSR1)
    assert rec["step"] > 60


@pytest.mark.e2e
@slow
def test_a_hung_peer_cannot_hold_the_stop_past_the_grace_period(tmp_path):
    """Rank 0 is frozen (SIGSTOP), rank 1 gets the notice: the vote never completes, so rank 1 exits
    with 143 when preempt.grace_s runs out, and the newest valid snapshot stays the periodic one."""
    run_dir = tmp_path / "run"
    job = Job(preempt_torchrun_cmd(run_dir, "preempt.grace_s=4"), tmp_path, "hung")
    ranks = job.workers(2)
    try:
        job.reached(run_dir, "snapshot", 100)
        job.reached(run_dir, "train", 110)
        os.kill(ranks[0], signal.SIGSTOP)
        t0 = time.monotonic()
        os.kill(ranks[1], signal.SIGTERM)
        while Path(f"/proc/{ranks[1]}").exists() and time.monotonic() - t0 < 30:
            stat = Path(f"/proc/{ranks[1]}/stat").read_text() if Path(f"/proc/{ranks[1]}").exists() else ""
            if stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]:
                break
            time.sleep(0.05)
        took = time.monotonic() - t0
    finally:
        job.kill()
        job.wait()
    assert 4 <= took < 8, took
    out, err = job.output()
    assert "preempt.grace_s=4 ran out" in err and "exiting with 143" in err, err[-3000:]
    assert inspect(run_dir)["global_step"] == 100  # nothing half-written became the newest
    assert not metrics(run_dir, "preempted")


@slow
def test_trainapp_node_drains_its_training_processes_before_stopping(tmp_path):
    """`trainapp node -- CMD` as a container's main process: `docker stop`'s SIGTERM reaches it alone
    (a container runtime signals PID 1); it sends the notice to the registered training process,
    waits for its snapshot, then stops the command."""
    run_dir = tmp_path / "run"
    job = Job([PY, "-m", "trainapp", "node", "--wait-s", "20", "--", *trainapp_cmd(run_dir)], tmp_path,
              "node")
    (pid,) = job.workers(1).values()
    rc = job.signal_after(run_dir, "train", 60, job.proc.pid)
    out, err = job.output()
    assert rc == 143, out + err
    assert "1 training process(es) stopped with their snapshot" in out, out
    rec = check_preempted(run_dir, job, None)
    assert rec["step"] > 60
    assert not (job.runtime / "workers" / str(pid)).exists()  # the worker unregistered itself


def test_the_registry_lists_live_workers_and_drops_dead_and_reused_pids(tmp_path, monkeypatch):
    monkeypatch.setenv(drain.RUNTIME_ENV, str(tmp_path))
    entry = drain.register()
    assert entry is not None and drain.registered() == [os.getpid()]
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "workers" / str(dead.pid)).write_text("1\n")  # a process that is gone
    (tmp_path / "workers" / "1").write_text("999999999\n")  # a live PID with another start time: reused
    assert drain.registered() == [os.getpid()]
    assert sorted(p.name for p in (tmp_path / "workers").iterdir()) == [str(os.getpid())]
    drain.unregister(entry)
    assert drain.registered() == []


def test_drain_and_node_do_not_import_torch(tmp_path):
    """They run as a pod's preStop and a container's PID 1: seconds and memory matter there."""
    r = run_cmd([PY, "-X", "importtime", "-m", "trainapp", "node", "--", "true"], timeout=60,
                env={drain.RUNTIME_ENV: str(tmp_path)})
    assert r.returncode == 0, r.output
    assert not re.search(r"\|\s+torch$", r.stderr, re.M), "torch was imported"


@slow
def test_a_notice_before_the_first_step_exits_at_once(tmp_path):
    """Nothing trained yet in this process: nothing to save, so no reason to sit out the grace period."""
    run_dir = tmp_path / "run"
    # A synthetic set large enough that building it takes a moment after the worker registers.
    job = Job(trainapp_cmd(run_dir, "data.train_size=200000"), tmp_path, "early")
    job.workers(1)
    t0 = time.monotonic()
    os.kill(job.proc.pid, signal.SIGTERM)
    rc = job.wait()
    out, err = job.output()
    assert rc == 143 and time.monotonic() - t0 < 10, (rc, err[-2000:])
    assert "SIGTERM before training started; nothing to save; exiting with 143" in err, err[-2000:]
    assert not (run_dir / "snapshots").exists() or not list((run_dir / "snapshots").iterdir())


POLL_SCRIPT = """
import json, sys, time
from trainapp.config import DistSection
from trainapp.launch import dist
from trainapp.faults.guard import RankGuard
from trainapp.faults.boundary import StopVote

ctx = dist.setup(DistSection(timeout_s=60))
# "pending": only rank 1 is told of a notice, from step 150 on: the ranks poll only after that.
state = {"step": 0}
pending = (lambda: ctx.rank == 1 and state["step"] >= 150) if sys.argv[2] == "pending" else None
if sys.argv[2] == "time":  # votes every ~50 ms: the poll clock, not the vote's cadence, sets the gaps
    StopVote.INTERVAL_S = 0.05
vote = StopVote(ctx, RankGuard().notices, poll_s=0.2, pending=pending)
polls, steps, t0 = [], [], time.perf_counter()
for step in range(1, 301):
    state["step"] = step
    steps.append(time.perf_counter() - t0)
    time.sleep(0.004 if ctx.rank == 0 else 0.009)  # the ranks' clocks and step times differ
    assert vote.stop(step) == 0
    began = time.perf_counter() - t0
    if vote.take_poll(lambda: time.sleep(0.1))[0]:  # the poll's barrier, slow (a busy Ray cluster)
        polls.append([step, began, time.perf_counter() - t0])
vote.close()
with open(sys.argv[1] + f"/polls.{ctx.rank}.json", "w") as f:
    json.dump({"polls": polls, "steps": steps}, f)
dist.teardown(ctx)
"""


def _polls(tmp_path: Path, mode: str) -> tuple[list[list], list[int], list[float]]:
    """Each rank's [step, seconds at its start, at its end] of its polls, the steps polled at (the same on
    both ranks), and the seconds at which each of rank 0's steps began."""
    script = tmp_path / "poll.py"
    script.write_text(POLL_SCRIPT)
    r = run_cmd([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), str(tmp_path), mode],
                timeout=120)
    assert r.returncode == 0, r.output[-3000:]
    kept = [json.loads((tmp_path / f"polls.{rank}.json").read_text()) for rank in (0, 1)]
    polls = [k["polls"] for k in kept]
    steps = [[step for step, *_ in p] for p in polls]
    assert steps[0] == steps[1], polls
    return polls, steps[0], kept[0]["steps"]


@pytest.mark.e2e
@slow
def test_the_ranks_agree_on_the_steps_of_a_timed_poll(tmp_path):
    """`StopVote(poll_s=...)`: the ranks of a group poll at the same steps (a barrier such as Ray's
    `get_preemption_info` needs every rank in it), by time: about every `poll_s` of training, many steps
    apart, counted from the end of the last poll (its barrier, 0.1 s here, is not training)."""
    polls, steps, began_at = _polls(tmp_path, "time")
    assert len(steps) >= 5, polls
    for (_, _, ended), (_, began, _) in zip(polls[0], polls[0][1:]):
        # Due poll_s after the last one ended, polled at the first vote after that: a vote's 50 ms, the
        # ranks' skew (0.2 s) and a step or two later at most, each step as long as it was measured here (a
        # busy machine holds one many times its 9 ms). The vote's clock starts when the poll returned, the
        # script's `ended` a moment later: a process descheduled in between reads a gap short by as much.
        step = max(b - a for a, b in zip(began_at, began_at[1:]) if ended <= b and a <= began)
        assert 0.2 - step <= began - ended <= 0.2 + 0.05 + 0.2 + 2 * step, (began - ended, step, polls[0])
    # Many steps apart on average (one interval may hold fewer where a second suite slows the steps).
    assert (steps[-1] - steps[0]) / (len(steps) - 1) >= 5, steps


@pytest.mark.e2e
@slow
def test_with_a_pending_check_the_ranks_poll_only_once_one_of_them_has_a_notice(tmp_path):
    """`StopVote(pending=...)`: no poll while no rank's `pending()` is true (Ray's barrier is not paid
    in a run that is never drained); once one rank's is (rank 1's, from step 150; rank 0's never),
    both poll at the same steps, at the next vote and then about every `poll_s`."""
    _, steps, _ = _polls(tmp_path, "pending")
    assert steps and steps[0] >= 150, steps
    assert steps[0] <= 150 + 0.5 / 0.009 + 5, steps  # the next vote: within half a second of rank 1's steps
    assert len(steps) >= 3 and (steps[-1] - steps[0]) / (len(steps) - 1) >= 5, steps

