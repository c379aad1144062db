"""One run per run directory: the lease and its fence (trainapp/snapshots/lease.py), and a resume that
says what changed (trainapp/config/changes.py). Real processes: a second run on a held directory, a
SIGKILLed holder in another pid namespace (a host this one cannot look into), a SIGSTOPped holder
resumed after the take-over (the zombie), the lease across torchrun's restarts; the config a resume
changes, listed or refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from helpers import PY, QUICK, REPO, at_step, exited, inspect, run_cmd, trainapp, wait_until

from trainapp import config
from trainapp.config import changes
from trainapp.errors import ConfigError
from trainapp.observe import metrics
from trainapp.snapshots import lease
from trainapp.snapshots.lease import Fence, Fenced, Lease, LeaseHeld
from trainapp.snapshots.lease_store import DirStore
from trainapp.tools import doctor, report

slow = pytest.mark.slow
# Long enough for a second run to start while it trains (a few seconds), snapshots every 50 steps.
RUN = [*QUICK, "train.log_every=25", "train.epochs=100", "train.max_steps=500", "snapshot.every_steps=50"]


class Background:
    """A process in its own session, output to a file, killed by process group at the end."""

    def __init__(self, cmd: list[str], log: Path):
        self.log = log
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def output(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def train_cmd(run_dir: Path, *args: str) -> list[str]:
    return [PY, "-m", "trainapp", "train", f"run.dir={run_dir}", *RUN, *args]


def wait(what, job: Background | None = None, timeout: float = 120, name: str = "the lease test's condition"):
    return wait_until(what, name, timeout, gone=exited(job.proc, job.output) if job else None)


def final_sha(run_dir: Path) -> str:
    return inspect(run_dir)["params_sha256"]


class Control:
    """RUN trained alone in a directory of its own, beside the run under test (two cores: side by side
    costs less wall time than one after the other); `sha()` its final parameters."""

    def __init__(self, tmp_path: Path):
        self.run_dir = tmp_path / "lone"
        self.job = Background(train_cmd(self.run_dir), tmp_path / "lone.log")

    def sha(self) -> str:
        assert self.job.wait() == 0, self.job.output()[-3000:]
        return final_sha(self.run_dir)


@pytest.fixture
def control(tmp_path):
    c = Control(tmp_path)
    try:
        yield c
    finally:
        c.job.kill()


# ----------------------------------------------------------------------------------------------
# The lease between processes, without training

HOLD = textwrap.dedent("""
    import sys, time
    from trainapp.snapshots.lease import Lease
    held = Lease.take(sys.argv[1], "alone", float(sys.argv[2])).start()
    print("held", held.generation, flush=True)
    time.sleep(600)
""")


def hold(run_dir: Path, term_s: float, log: Path) -> Background:
    job = Background([PY, "-c", HOLD, str(run_dir), str(term_s)], log)
    wait(lambda: "held" in job.output(), job, name="held")
    return job


def test_only_one_of_many_processes_creates_a_generation(tmp_path):
    """Eight processes race to create generation 1 of one folder: exactly one wins."""
    code = ("import sys; from trainapp.snapshots.lease_store import DirStore; "
            "print(DirStore(sys.argv[1]).create('gen-000000001.json', sys.argv[2].encode()))")
    procs = [subprocess.Popen([PY, "-c", code, str(tmp_path / "lease"), f"writer {i}"],
                              stdout=subprocess.PIPE, text=True) for i in range(8)]
    won = [i for i, p in enumerate(procs) if p.communicate(timeout=60)[0].strip() == "True"]
    assert len(won) == 1, won
    assert (tmp_path / "lease" / "gen-000000001.json").read_text() == f"writer {won[0]}"
    assert sorted(os.listdir(tmp_path / "lease")) == ["gen-000000001.json"]  # no temporary file left


def test_a_live_holder_stops_a_second_taker_in_seconds_naming_it(tmp_path):
    job = hold(tmp_path, 30, tmp_path / "holder.log")
    try:
        t0 = time.monotonic()
        with pytest.raises(LeaseHeld) as e:
            Lease.take(str(tmp_path), "alone", 30)
        assert time.monotonic() - t0 < 6
        assert f"pid {job.proc.pid} on host" in str(e.value) and "run.take_over=true" in str(e.value)
    finally:
        job.kill()


def test_a_dead_holder_on_this_host_is_taken_over_at_once_and_fenced(tmp_path, caplog):
    job = hold(tmp_path, 30, tmp_path / "holder.log")
    job.kill()
    job.proc.wait()
    t0 = time.monotonic()
    took = Lease.take(str(tmp_path), "alone", 30)
    assert time.monotonic() - t0 < 2
    assert took.generation == 2 and took.took_over["why"] == "its process is gone"
    assert took.took_over["holder"]["pid"] == job.proc.pid
    assert f"took over the lease of alone pid {job.proc.pid}" in caplog.text
    stale = Fence(DirStore(tmp_path / "lease"), 1, str(tmp_path))
    with pytest.raises(Fenced, match="taken over by alone pid"):
        stale.check("snapshot")
    took.fence.check()  # the new holder's own fence holds


def test_doctor_says_who_holds_the_run_dir_and_whether_a_new_run_would_stop(tmp_path):
    cfg = config.load(None, [f"run.dir={tmp_path}"])
    assert doctor.check_lease(cfg).detail.endswith("free: no run has held it yet")
    job = hold(tmp_path, 30, tmp_path / "holder.log")
    try:
        check = doctor.check_lease(cfg)
        assert check.status == "warn" and f"in use by alone pid {job.proc.pid}" in check.detail, check
    finally:
        job.kill()
    job.proc.wait()
    check = doctor.check_lease(cfg)
    assert check.status == "ok" and "whose process is gone" in check.detail, check


def test_take_over_true_takes_a_live_holders_lease_which_then_finds_itself_fenced(tmp_path):
    job = hold(tmp_path, 30, tmp_path / "holder.log")
    try:
        took = Lease.take(str(tmp_path), "alone", 30, take_over=True)
        assert took.took_over["why"] == "run.take_over=true"
        # The old holder's renewal thread sees generation 2 and stops renewing its own.
        before = json.loads((tmp_path / "lease" / "gen-000000001.json").read_text())["renewals"]
        time.sleep(5)
        after = json.loads((tmp_path / "lease" / "gen-000000001.json").read_text())["renewals"]
        assert after <= before + 1, (before, after)
        assert "run lease lost" in job.output()
    finally:
        job.kill()


def test_a_fenced_snapshot_write_publishes_nothing_and_leaves_nothing(tmp_path):
    """The fence is the write's last word before the rename: a lease lost by then leaves no snapshot,
    whole or half (the background writer of snapshot.async goes through the same write)."""
    import torch

    from trainapp.snapshots.store import write_dir

    stale = Lease.take(str(tmp_path), "alone", 30)
    Lease.take(str(tmp_path), "alone", 30, take_over=True)
    with pytest.raises(Fenced, match="before its next snapshot"):
        write_dir(tmp_path / "snapshots" / "step_000000010", {"model": {"w": torch.ones(3)}},
                  {"global_step": 10}, before_publish=lambda: stale.fence.check("snapshot"))
    assert os.listdir(tmp_path / "snapshots") == []


def test_a_released_lease_and_the_same_jobs_restart_are_taken_quietly(tmp_path, monkeypatch):
    first = Lease.take(str(tmp_path), "alone", 30).start()
    first.release()
    second = Lease.take(str(tmp_path), "torchrun", 30)
    assert second.generation == 2 and second.took_over is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    a = Lease.take(str(tmp_path / "b"), "torchrun", 30).start()  # not released: its "restart" comes next
    restart = Lease.take(str(tmp_path / "b"), "torchrun", 30)
    assert restart.generation == 2 and restart.took_over is None
    assert a.fence.lost()
    a.release()  # a fenced lease is not released: the restart's stays
    assert not json.loads((tmp_path / "b" / "lease" / "gen-000000002.json").read_text())["released"]


def test_a_stop_request_in_the_lease_reaches_a_writers_notices(tmp_path):
    """The Ray driver's stop (trainapp/launch/ray/stop.py): written into its lease, read by rank 0's
    watch, handled as a notice that records who asked."""
    from trainapp.faults.heartbeat import Heartbeat
    from trainapp.faults.preempt import Notices
    from trainapp.launch.ray.worker import StopWatch

    held = Lease.take(str(tmp_path), "ray", 30)
    writer = Fence.from_dict(held.fence.to_dict())  # as the driver hands it to the workers
    assert lease.stop_request(writer) is None
    ended = []
    notices = Notices(Heartbeat(), lambda *a: ended.append(a))
    notices.heartbeat.phase = "compute"  # a step is under way: the stop comes after it
    watch = StopWatch(writer, None, notices, poll_s=0.05)
    held.request_stop("SIGTERM", "ray job stop (SIGTERM to the job's driver)")
    wait(lambda: notices.signum, name="a notice")
    watch.stop.set()
    assert notices.signum == signal.SIGTERM and notices.stop_by.startswith("ray job stop") and not ended
    assert notices.stop_kind == "stop" and lease.stop_request(writer)["signal"] == "SIGTERM"


def test_a_resize_request_becomes_a_notice_once_training_and_is_answered_at_once_before(tmp_path):
    """The Ray controller's resize (trainapp/launch/ray/resize.py): a request made while this attempt trains
    is a `resize` notice; one older than the watch (a dead controller's) or made before the first step is
    answered at once without a snapshot, once."""
    from trainapp.faults.heartbeat import Heartbeat
    from trainapp.faults.preempt import Notices
    from trainapp.launch.ray import resize
    from trainapp.launch.ray.worker import StopWatch

    store = lease.store_at(str(tmp_path))
    store.path.mkdir(parents=True)
    old = resize.ask(store, 2, 1)  # left by a controller that died before this attempt
    time.sleep(0.01)  # its time is rounded to the millisecond
    notices = Notices(Heartbeat(), lambda *a: None)
    notices.heartbeat.phase = "compute"
    watch = StopWatch(Fence.none(), store, notices, poll_s=0.02)
    wait(lambda: resize.wait(store, old, 0.05) is not None, name="a resize")
    assert resize.wait(store, old, 0.05)["step"] is None and not notices.signum
    resize.clear(store, old)
    rid = resize.ask(store, 1, 2)
    wait(lambda: notices.signum, name="a notice")
    watch.stop.set()
    assert ((notices.stop_kind, notices.stop_by, watch.resize_id)
            == ("resize", "resize from 1 to 2 workers", rid))


# ----------------------------------------------------------------------------------------------
# What a resume changes


def test_config_changes_are_listed_and_the_meaningless_ones_refused():
    old = {"seed": 1, "optim": {"lr": 0.05}, "task": {"name": "x:y", "args": {"hidden": 8}},
           "run": {"dir": "a"}}
    new = {"seed": 1, "optim": {"lr": 0.5}, "task": {"name": "x:y", "args": {"hidden": 8}},
           "run": {"dir": "a"}}
    diff = changes.check_resume(old, new, [], "snap")
    assert diff == {"optim.lr": [0.05, 0.5]} and changes.line(diff) == "optim.lr 0.05 -> 0.5"
    for key, value in (("seed", 2), ("task.args.hidden", 16)):
        changed = json.loads(json.dumps(new))
        node = changed
        *path, leaf = key.split(".")
        for part in path:
            node = node[part]
        node[leaf] = value
        with pytest.raises(ConfigError, match=rf"^{key}={value}: the snapshot snap was trained with"):
            changes.check_resume(old, changed, [], "snap")
        # a section allows its keys
        assert key in changes.check_resume(old, changed, [key.split(".")[0]], "snap")
    assert changes.check_resume(None, new, [], "snap") == {}


@slow
def test_a_resume_lists_what_changed_and_refuses_another_seed_unless_allowed(tmp_path):
    run_dir = tmp_path / "run"
    short = [f"run.dir={run_dir}", *QUICK, "train.max_steps=20"]
    assert trainapp("train", *short).returncode == 0
    r = trainapp("train", *short, "seed=5")
    assert r.returncode == 2, r.output
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert (len(errors) == 1 and "seed=5: the snapshot" in errors[0]
            and "run.allow_changes=[seed]" in errors[0])
    assert "Traceback" not in r.output
    assert len(metrics.read(run_dir, "start")) == 1  # refused before it wrote anything

    r = trainapp("train", *short, "optim.lr=0.5", "train.max_steps=40")
    assert r.returncode == 0, r.output[-2000:]
    assert "with config changes: optim.lr 0.05 -> 0.5, train.max_steps 20 -> 40" in r.stderr
    start = metrics.read(run_dir, "start")[-1]
    assert start["config_changes"] == {"optim.lr": [0.05, 0.5], "train.max_steps": [20, 40]}
    r = trainapp("train", *short, "optim.lr=0.5", "train.max_steps=45", "seed=5", "run.allow_changes=seed")
    assert r.returncode == 0, r.output[-2000:]
    assert metrics.read(run_dir, "start")[-1]["config_changes"]["seed"] == [0, 5]
    text = report.summarize(run_dir, report.read(run_dir))
    assert ("config         attempt 1 resumed with optim.lr 0.05 -> 0.5, train.max_steps 20 -> 40"
            in text), text


# ----------------------------------------------------------------------------------------------
# Runs on one directory


@slow
def test_a_second_run_on_a_held_dir_exits_2_in_seconds_and_the_first_is_unharmed(tmp_path, control):
    run_dir = tmp_path / "run"
    first = Background(train_cmd(run_dir), tmp_path / "first.log")
    try:
        wait(lambda: (run_dir / "lease" / "gen-000000001.json").exists(), first, name="lease generation 1")
        t0 = time.monotonic()
        r = run_cmd(train_cmd(run_dir, "seed=2"))
        took = time.monotonic() - t0
        assert first.proc.poll() is None, "the first run ended before the second was refused: make RUN longer"
        assert first.wait() == 0, first.output()[-3000:]
        lone_sha = control.sha()
    finally:
        first.kill()
    assert r.returncode == 2, r.output[-3000:]
    assert took < 15, took  # python and torch imports, then at most a few renewal intervals
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert (len(errors) == 1
            and f"is in use by another run: alone pid {first.proc.pid} on host" in errors[0]), errors
    assert "Traceback" not in r.output
    starts = metrics.read(run_dir, "start")
    assert len(starts) == 1 and {r["pid"] for r in metrics.read(run_dir)} == {first.proc.pid}
    assert final_sha(run_dir) == lone_sha  # bitwise the run it would have been alone


@pytest.mark.e2e
def test_a_sigkilled_holder_on_another_host_is_taken_over_after_its_term(tmp_path, control):
    """The holder runs in a pid namespace of its own: to the next run it is a process it cannot look
    into, as on another host, so only the lease's term can say it is dead."""
    run_dir = tmp_path / "run"
    holder = Background(["unshare", "--pid", "--fork", "--kill-child", *train_cmd(run_dir, "run.lease_s=4")],
                        tmp_path / "holder.log")
    try:
        wait(at_step(run_dir, "snapshot", 50), holder, name="snapshot 50")
    finally:
        holder.kill()
    holder.proc.wait()
    t0 = time.monotonic()
    r = run_cmd(train_cmd(run_dir, "run.lease_s=4"))
    assert r.returncode == 0, r.output[-3000:]
    assert time.monotonic() - t0 > 4  # it waited out the term, renewals never came
    took = metrics.read(run_dir, "start")[-1]["lease"]["took_over"]
    assert took["why"].startswith("its heartbeat stopped") and took["generation"] == 1, took
    assert "took over the lease of alone pid" in r.stderr
    assert final_sha(run_dir) == control.sha()
    text = report.summarize(run_dir, report.read(run_dir))
    assert "take-over      attempt 1 took the run directory over from alone pid" in text, text


@pytest.mark.e2e
def test_a_sigstopped_holder_resumed_after_the_take_over_publishes_nothing_and_exits(tmp_path, control):
    run_dir = tmp_path / "run"
    zombie = Background(train_cmd(run_dir, "run.lease_s=3"), tmp_path / "zombie.log")
    heir = None
    try:
        wait(at_step(run_dir, "snapshot", 50), zombie, name="snapshot 50")
        os.kill(zombie.proc.pid, signal.SIGSTOP)
        stopped_at = max(r["step"] for r in metrics.read(run_dir, "snapshot"))
        heir = Background(train_cmd(run_dir, "run.lease_s=3"), tmp_path / "heir.log")
        wait(lambda: "took over the lease" in heir.output(), heir, name="the takeover")
        wait(lambda: len(metrics.read(run_dir, "train", missing_ok=True)) and
             metrics.read(run_dir)[-1]["pid"] == heir.proc.pid, heir, name="the heir's first step")
        os.kill(zombie.proc.pid, signal.SIGCONT)
        assert zombie.wait(60) == 2, zombie.output()[-3000:]
        assert heir.wait() == 0, heir.output()[-3000:]
    finally:
        zombie.kill()
        if heir is not None:
            heir.kill()
    said = [ln for ln in zombie.output().splitlines() if "fenced" in ln]
    assert said and "was taken over by alone pid" in said[0] and "publishes nothing more" in said[0], said
    records = metrics.read(run_dir)
    heir_start = next(i for i, r in enumerate(records) if r["kind"] == "start" and r["pid"] == heir.proc.pid)
    assert all(r["pid"] == heir.proc.pid for r in records[heir_start:]), \
        "the zombie wrote into the heir's run"
    for snap in (run_dir / "snapshots").iterdir():
        meta = json.loads((snap / "meta.json").read_text())
        assert meta["lease_generation"] == 2 or meta["global_step"] <= stopped_at + 50, meta
    assert final_sha(run_dir) == control.sha()


@slow
def test_torchruns_restart_takes_the_lease_of_its_own_job_quietly(torchrun_restarted):
    """conftest's run: rank 1 SIGKILLed at step 13, the group restarted by torchrun."""
    starts = metrics.read(torchrun_restarted, "start")
    assert [s["lease"]["generation"] for s in starts] == [1, 2]
    assert starts[1]["lease"]["took_over"] is None  # the same job: no take-over, no warning
    assert starts[0]["lease"]["holder"]["job"] == starts[1]["lease"]["holder"]["job"]
    assert starts[0]["lease"]["holder"]["job"].startswith("torchrun:")
    meta = json.loads(sorted((torchrun_restarted / "snapshots").iterdir())[-1]
                      .joinpath("meta.json").read_text())
    assert meta["lease_generation"] == 2

