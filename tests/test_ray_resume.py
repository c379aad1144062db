"""A Ray training worker killed or stopped mid-run on the local cluster (conftest.py's `cluster`, the one
tests/test_ray.py uses), and what the restarted worker group resumes from: the storage tier at most one
snapshot interval back, the memory tier one step back, the newest snapshot on storage or on a `file://`
URI store where Ray registered none, a shipped user task to torchrun's parameters, and a SIGTERMed
worker's own snapshot with zero steps redone. Jobs go in through real `ray job submit`
(tests/ray_jobs.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from helpers import (PY, REPO, inspect, metrics, one_error_line, run_cmd, torchrun2, torchrun_cmd, trainapp,
                     wait_for_record, wait_for_step, wait_until)
from ray_jobs import (KILLABLE_RUN, USER_TASK, finish, redone_steps, signal_at_step, submit,
                      submit_background, training_worker_pids)

from devtools.local_ray import proc_stat
from trainapp.faults.failure import PEER_GONE
from trainapp.snapshots.store import list_snapshots, step_of
from trainapp.tools import report

pytestmark = pytest.mark.slow


def _nice(pid: int) -> int:
    return int(proc_stat(pid)[1][16])


@pytest.mark.e2e
def test_sigkilled_ray_worker_costs_at_most_one_snapshot_interval(cluster):
    run_dir = cluster.storage / "killed"
    proc = submit_background(cluster, "killed", *KILLABLE_RUN)
    try:
        pids = training_worker_pids(run_dir)
        # Training runs at full priority (Ray's default would be nice 15, below Ray's own daemons);
        # the head's processes yield to it.
        assert [_nice(pid) for pid in pids] == [cluster.worker_nice] * 2
        gcs = cluster.node_pids("head")["gcs_server"]
        assert _nice(gcs) == cluster.head_nice > cluster.worker_nice
        # Where the kernel shares the CPU between sessions first (autogroups), the head's session as a
        # whole yields too: its processes' nice values alone would rank them only among themselves.
        autogroup = Path(f"/proc/{gcs}/autogroup")
        if autogroup.exists():
            assert autogroup.read_text().split()[-1] == str(cluster.head_nice), autogroup.read_text()
        # Ray Train's controller runs the backend and the callbacks and trains nothing: it has no torch
        # loaded (trainapp/launch/ray/private/backend.py keeps it out; its import is on the start-up's
        # critical path).
        controller = cluster.actor_pids("TrainController")
        assert len(controller) == 1, controller
        assert "libtorch" not in Path(f"/proc/{controller[0]}/maps").read_text()
        wait_for_step(run_dir, 12)
        killed_at = time.time()
        os.kill(pids[-1], signal.SIGKILL)
    finally:
        rc, out = finish(proc)
    assert rc == 0, out[-4000:]
    before, resumed = redone_steps(run_dir)
    assert resumed % 5 == 0 and before - resumed <= 5 and resumed < 40, (before, resumed)
    assert inspect(run_dir)["global_step"] == 40
    # The killed rank wrote nothing; Ray Train's controller recorded what it saw, between the kill and
    # the new group's start, and the report says it.
    records = metrics(run_dir)
    seen = [r for r in records if r["kind"] == "group_failure"]
    starts = [r for r in records if r["kind"] == "start"]
    assert len(seen) == 1 and killed_at < seen[0]["time"] < starts[1]["time"], (seen, killed_at)
    # The killed worker fails Ray's health check (or its actor is seen dead), or the controller hears first
    # from the other one, whose collective lost its peer: which comes first is the machine's timing.
    said = report.failures(records)
    assert len(said) == 1, said
    errors = list(seen[0]["errors"].values())
    if any(e.startswith(("WorkerHealthCheckFailedError", "ActorDiedError")) for e in errors):
        assert said[0].startswith("attempt 0: Ray Train saw rank"), said  # the silent rank, by Ray's word
    else:  # the survivor's line, Gloo's words kept; its own record, where it wrote one, leads the report
        assert errors and all(any(s in e for s in PEER_GONE) for e in errors), seen
        assert (said[0].startswith("attempt 0: Ray Train saw rank")
                or ": peer: a peer's connection closed: it died without a word" in said[0]), said
    # The restarted group's start-up phases, for the recovery breakdown (trainapp/observe/timeline.py); it
    # started in fresh processes: spares start only once a worker has run `ray.spare_after_s` (30 s).
    assert ({"worker_process", "worker_setup", "process_group", "built", "loaded"}
            <= starts[1]["startup"].keys())
    assert "worker_preloaded" not in starts[1]["startup"], starts[1]["startup"]
    assert (killed_at < starts[1]["startup"]["worker_setup"] < starts[1]["startup"]["loaded"]
            < starts[1]["time"])


@pytest.mark.e2e
def test_a_sigkilled_ray_worker_resumes_from_memory_in_spare_processes_redoing_at_most_one_step(
        cluster, straight_sha):
    """The memory tier under Ray Train: a copy every step in a memory directory of the test's own (the
    worker nodes share this machine's), storage snapshots every 50 steps. Spare processes start at once
    (`ray.spare_after_s=0`), one per worker; once both are idle, a worker is SIGKILLed (rank 0 sleeps 800
    ms a step, which changes no number, so that the run is still training then). Ray Train restarts the
    group in the spares, whose workers resume the newest step in memory (one step redone, none read from
    storage), to torchrun's parameters. The finished run leaves no copy in memory, and the job's end
    leaves no spare process and no spare's file."""
    run_dir = cluster.storage / "memory"
    memory = Path(tempfile.mkdtemp(prefix="ta-test-mem-", dir="/dev/shm"))
    args = [*KILLABLE_RUN, "snapshot.every_steps=50", "snapshot.memory_every_steps=1",
            f"snapshot.memory_dir={memory}", "ray.spare_after_s=0", "drill.slow_rank=0", "drill.slow_ms=800"]

    def two_spares() -> dict[int, Path] | None:
        found = cluster.spare_pids()
        return found if len(found) == 2 else None

    try:  # the memory directory goes whatever fails
        proc = submit_background(cluster, "memory", *args)
        try:
            pids = training_worker_pids(run_dir)
            waiting = wait_until(two_spares, "two idle spares", 120)
            killed_at = time.time()
            os.kill(pids[-1], signal.SIGKILL)
        finally:
            rc, out = finish(proc)
        assert rc == 0, out[-4000:]
        before, resumed = redone_steps(run_dir)
        assert before - resumed <= 1 and resumed < 40, (before, resumed)
        start = metrics(run_dir, "start")[1]
        assert start["resumed_tier"] == "memory" and start["resumed_from"].startswith("memory:"), start
        # The new group ran in the spares, their imports done before the kill.
        assert sorted(p["pid"] for p in start["placement"]) == sorted(waiting), (start["placement"], waiting)
        assert start["startup"]["worker_preloaded"] < killed_at < start["startup"]["worker_setup"], start
        assert inspect(run_dir)["params_sha256"] == straight_sha(torchrun2, *KILLABLE_RUN)
        assert sorted(p.name for p in memory.iterdir()) == ["node-id"]
        # Ray ends a job's idle processes with it (the spares the new group asked for, if they started),
        # and the driver removes the job's spare folder.
        wait_until(lambda: not cluster.spare_pids(), "the spares to end with the job", 30)
        assert not any(path.parent.exists() for path in waiting.values()), waiting
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def _steps_on(storage: Path) -> list[int]:
    return [step_of(p.name) for p in list_snapshots(storage)]


@pytest.mark.e2e
def test_snapshots_ray_never_registered_resume_a_killed_run_and_are_deleted_once_superseded(cluster):
    """`ray.report_interval_s` longer than the run: Ray registers only the final snapshot. With the
    workers frozen (SIGSTOP) after a snapshot, storage holds that one and at most the next, being
    written: every older one Ray never knew is gone. A SIGKILLed worker then costs at most one snapshot
    interval (the restart finds the newest snapshot on storage), and the run resubmits with the same
    name (Ray's record names no snapshot trainapp deleted)."""
    name = "unregistered"
    run_dir = cluster.storage / name
    # Steps of at least 100 ms (rank 0 sleeps; the numbers do not change): the 40 steps take 2 s here
    # without it, and on a busy machine the run was over before the workers were frozen.
    proc = submit_background(cluster, name, *KILLABLE_RUN, "ray.report_interval_s=1000", "drill.slow_rank=0",
                             "drill.slow_ms=100")
    try:
        pids = training_worker_pids(run_dir)
        wait_for_record(run_dir, "snapshot", lambda r: r["step"] >= 15)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        newest = max(r["step"] for r in metrics(run_dir, "snapshot"))  # written after older ones went
        frozen = _steps_on(run_dir)
        os.kill(pids[-1], signal.SIGKILL)
        for pid in pids[:-1]:
            os.kill(pid, signal.SIGCONT)
    finally:
        rc, out = finish(proc)
    assert rc == 0, out[-4000:]
    assert frozen and set(frozen) <= {newest, newest + 5}, (frozen, newest)
    before, resumed = redone_steps(run_dir)
    assert resumed >= max(frozen) and before - resumed <= 5 and resumed < 40, (before, resumed, frozen)
    assert _steps_on(run_dir) == [40]  # the final one, registered; every unknown one went when it was
    r = submit(cluster, name, *KILLABLE_RUN, "train.max_steps=45", "ray.report_interval_s=1000")
    assert r.returncode == 0, r.output[-4000:]
    assert metrics(run_dir, "start")[-1]["resumed_step"] == 40
    assert _steps_on(run_dir) == [40, 45]  # Ray keeps snapshot.keep=3 of the ones it knows
    # A snapshot Ray knows, deleted by hand: Ray Train would refuse the run with a traceback and the
    # advice to delete the run's directory. The driver says so in one line, and its fix works.
    shutil.rmtree(run_dir / "step_000000040")
    r = trainapp("ray", f"ray.address={cluster.address}", f"ray.storage_path={cluster.storage}",
                 f"ray.name={name}", *KILLABLE_RUN, timeout=90, env=cluster.client_env(), fresh=True)
    line = one_error_line(r, "ray", "step_000000040, gone from")
    assert "move the record aside" in line, line
    (run_dir / "checkpoint_manager_snapshot.json").rename(run_dir / "ray-record.json")
    r = submit(cluster, name, *KILLABLE_RUN, "train.max_steps=50", "ray.report_interval_s=1000")
    assert r.returncode == 0, r.output[-4000:]
    assert metrics(run_dir, "start")[-1]["resumed_step"] == 45


@pytest.mark.e2e
def test_uri_storage_resumes_from_the_newest_uploaded_snapshot_ray_never_registered(cluster, tmp_path):
    """`ray.storage_path` a file:// URI, no report but the final one, `snapshot.async` (the upload, and
    the deletion of the upload it supersedes, in the writer's thread): the restart after a SIGKILLed
    worker lists the store and resumes from the newest snapshot uploaded, not from Ray's (none)."""
    store, run_dir = tmp_path / "bucket", tmp_path / "run"
    proc = submit_background(cluster, "uri-unregistered", *KILLABLE_RUN, f"ray.storage_path=file://{store}",
                             f"run.dir={run_dir}", "ray.report_interval_s=1000", "snapshot.async=true")
    try:
        pids = training_worker_pids(run_dir)
        # A background write starts only once the one before it is complete: with the record of
        # snapshot 20 (written as its write starts), 15 is on the store.
        wait_for_record(run_dir, "snapshot", lambda r: r["step"] >= 20)
        os.kill(pids[-1], signal.SIGKILL)
    finally:
        rc, out = finish(proc)
    assert rc == 0, out[-4000:]
    before, resumed = redone_steps(run_dir)
    # At most one interval and the write in flight when the worker died.
    assert resumed >= 15 and before - resumed <= 10, (before, resumed)
    # Every upload Ray never knew went once a newer one was complete: the store holds what Ray's record
    # names. That is the final one (the flush at the end) and, where the resumed attempt completed an
    # upload before the final save's report, the newest such one (35 on a quiet machine; none where the
    # resume was at 35, on a busy one).
    record = json.loads((store / "uri-unregistered" / "checkpoint_manager_snapshot.json").read_text())
    known = sorted(step_of(r["checkpoint_dir_name"]) for r in record["checkpoint_results"])
    assert _steps_on(store / "uri-unregistered") == known and known[-1] == 40 and len(known) <= 2, \
        (known, resumed)


@pytest.mark.e2e
def test_a_user_task_shipped_with_working_dir_resumes_a_killed_worker_bitwise_as_under_torchrun(cluster,
                                                                                                tmp_path):
    """`ray job submit --working-dir` ships the user's package to the driver and the workers. Rank 1
    SIGKILLs itself after step 13; the run ends where torchrun's straight run does."""
    task = USER_TASK
    # What `make ray-submit WORKING_DIR=examples/tabular` runs.
    r = run_cmd([PY, "-m", "devtools.local_ray", "--dir", str(cluster.dir), "submit", "--working-dir",
                 "examples/tabular", "--", "python", "-m", "trainapp", "ray",
                 f"ray.storage_path={cluster.storage}", "ray.name=usertask", *task,
                 "drill.kill_at_step=13", "drill.rank=1"], timeout=400, env=cluster.env())
    assert r.returncode == 0, r.output[-4000:]
    assert "trainapp ray: done steps=24" in r.output and "val_mse=" in r.output, r.output[-2000:]
    run_dir = cluster.storage / "usertask"
    first, again = metrics(run_dir, "start")
    # The memory tier's `auto` cadence may hold a newer step than the storage snapshot at 10: either serves.
    assert first["resumed_step"] is None and (
        (again["resumed_tier"], again["resumed_step"]) == ("storage", 10)
        or (again["resumed_tier"] in ("memory", "peer") and 10 <= again["resumed_step"] <= 13)), again
    t = run_cmd([*torchrun_cmd(2), f"run.dir={tmp_path / 'tr'}", *task],
                env={"PYTHONPATH": str(REPO / "examples" / "tabular")})
    assert t.returncode == 0, t.output[-3000:]
    assert inspect(run_dir)["params_sha256"] == inspect(tmp_path / "tr")["params_sha256"]


@pytest.mark.e2e
def test_sigterm_to_a_ray_training_worker_stops_every_worker_at_one_step_and_redoes_none(cluster):
    """SIGTERM reaching one Ray training worker (its node's shutdown, a container runtime): all workers
    agree on the step, rank 0 reports the snapshot of it, the workers exit 143 and Ray Train restarts
    the group from that snapshot. Periodic snapshots are off: nothing else could serve the resume."""
    run_dir = cluster.storage / "sigterm"
    rc, out = signal_at_step(cluster, "sigterm", 10, signal.SIGTERM, *KILLABLE_RUN, "train.max_steps=150",
                             "snapshot.every_steps=0")
    assert rc == 0, out[-4000:]
    (rec,) = metrics(run_dir, "preempted")
    assert rec["signal"] == "SIGTERM" and rec["seconds"] < 25, rec
    before, resumed = redone_steps(run_dir)
    assert resumed == rec["step"] >= before, (before, resumed, rec)  # zero steps redone
    # Once: Ray Train's print patch, which would also send the line through its logger, is off.
    assert out.count("trainapp: preempted (SIGTERM) at step") == 1, out[-4000:]
    assert inspect(run_dir)["global_step"] == 150
