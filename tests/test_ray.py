"""The Ray launcher against a real local multi-node cluster (conftest.py's `cluster`: `ray start` head + 2
worker nodes on loopback, its own directory and HOME, torn down by PID). Jobs go in through real `ray job
submit` (tests/ray_jobs.py). Here: the launch and a fault drill run, user tasks, failures explained, bad
input, a lost and a drained node, stopping a job, `doctor --comm`; a killed or SIGTERMed worker's resume
is in tests/test_ray_resume.py, on the same cluster."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from statistics import median

import pytest
import usertasks_stream
from helpers import (FAULT_RUN, QUICK, REPO, exited, inspect, metrics, one_error_line, run_cmd, torchrun,
                     trainapp, wait_for_record, wait_for_step, wait_until)
from ray_jobs import (KILLABLE_RUN, USER_TASK, finish, node_of, one_record, redone_steps, steps_at_world_size,
                      submit, submit_background, submit_cmd)

from devtools.local_ray import RAY, proc_stat
from trainapp.faults.boundary import StopVote
from trainapp.observe.logs import FIRST_STEP

pytestmark = pytest.mark.slow


DRILL_DELAY_S = 0.5


@pytest.fixture(scope="module")
def ray_run_with_restart(cluster):
    """FAULT_RUN (conftest.py's `torchrun_straight` trains it under torchrun) as a 2-worker job whose rank
    1 SIGKILLs itself after step 13 (drill.kill_at_step); every snapshot write is slowed by the
    drill.snapshot_write_delay_s drill; it logs to an MLflow store (SQLite). Resumed by the storage tier
    (FAULT_RUN's; the memory tier's resumes: test_ray_resume.py)."""
    name = "drill"
    r = submit(cluster, name, *FAULT_RUN, "drill.kill_at_step=13", "drill.rank=1",
               f"drill.snapshot_write_delay_s={DRILL_DELAY_S}",
               f"observe.mlflow_uri=sqlite:///{cluster.storage}/mlflow.db")
    return r, cluster.storage / name


def test_job_submit_runs_two_workers_and_inspect_reads_the_ray_run(cluster, ray_run_with_restart):
    r, run_dir = ray_run_with_restart
    assert r.returncode == 0, r.output[-4000:]
    assert "trainapp ray: done steps=24" in r.output and "world_size=2" in r.output
    # Ray stops a worker group whose training is over with SIGTERM: no preemption notice. (Only the attempt
    # that finished: the first one's rank 0, SIGTERMed by Ray after rank 1 died, may get it before it sees
    # its peer gone on a busy machine, a failing group's survivor trainapp cannot tell from a preempted one.)
    finished = r.output.rsplit("first step of this attempt trained", 1)[-1]
    assert "preemption: SIGTERM received" not in finished, finished[-4000:]
    assert {m["world_size"] for m in metrics(run_dir, "train")} == {2}
    # Each local node has an address of its own: Ray Train places the ranks as on two machines.
    placement = metrics(run_dir, "start")[0]["placement"]
    assert sorted((p["node_rank"], p["local_rank"]) for p in placement) == [(0, 0), (1, 0)], placement
    # No Ray Data actor for a run without Ray datasets (private/trainer.py's TorchTrainer), but Ray Train's
    # own helpers are there: the state API answers and lists them.
    cluster_actors = {a["class_name"] for a in cluster.state("actors")}
    assert "SynchronizationActor" in cluster_actors and "DatasetManager" not in cluster_actors, cluster_actors
    # Per-rank timings under Ray too: every log interval, both ranks, each on its node.
    ranks = metrics(run_dir, "ranks")
    assert ranks and all([e["rank"] for e in r_["ranks"]] == [0, 1] and r_["ranks"][1]["step_ms"] > 0
                         for r_ in ranks)
    # One copy of each line in the job's output (two attempts): each node streams only its own logs.
    assert r.output.count("Started training worker group") == 2, r.output[-4000:]
    assert r.output.count("trainapp.core.loop: world_size=2 backend=gloo") == 2, r.output[-4000:]
    # The driver held Ray's lines until rank 0's first step of each attempt, then showed them
    # (trainapp/launch/ray/output.py): nothing of a training run is left out. (Each process's lines come in
    # their order; the controller's and the workers' reach the driver on streams of their own.)
    assert r.output.count(FIRST_STEP) == 2, r.output[-4000:]
    # Ray Train's line per report per rank stays in its own log files, out of the job's output.
    assert "Reporting training result" not in r.output, r.output[-4000:]
    train_logs = [f.read_text() for f in cluster.dir.glob("**/logs/train/ray-train-*-worker-*.log")]
    assert any("Reporting training result" in text for text in train_logs), len(train_logs)
    info = inspect(run_dir)
    assert info["global_step"] == 24 and info["world_size"] == 2
    # The end-of-run export (run.export), beside the snapshots on ray.storage_path.
    exported = json.loads((run_dir / "model" / "trainapp.json").read_text())
    assert exported["step"] == 24 and exported["source"]["params_sha256"] == info["params_sha256"], exported
    assert f"model exported: {run_dir}/model" in r.output
    assert (run_dir / "step_000000024" / "state.pt").exists()


def test_fault_drill_inside_a_ray_worker_resumes_and_reaches_the_planned_step(ray_run_with_restart):
    r, run_dir = ray_run_with_restart
    assert r.returncode == 0, r.output[-4000:]
    assert (run_dir / "fault-fired-step13-rank1").exists()  # rank 1 died at step 13
    starts = metrics(run_dir, "start")
    assert len(starts) == 2 and starts[1]["resumed_step"] == 10
    assert inspect(run_dir)["global_step"] == 24
    # Ray Train's retry is the same run: the driver's lease, one generation, never taken over.
    assert [s["lease"]["generation"] for s in starts] == [1, 1]
    assert starts[0]["lease"]["holder"]["launcher"] == "ray" and starts[1]["lease"]["took_over"] is None
    assert json.loads((run_dir / "lease" / "gen-000000001.json").read_text())["released"]


def test_a_ray_retry_logs_to_the_same_mlflow_run_each_step_once(cluster, ray_run_with_restart):
    """Ray Train's retry of the worker group opens the MLflow run the first attempt made (its id kept in
    the run directory), and the steps the retry trained again are there once, with the retry's values."""
    from mlflow.tracking import MlflowClient

    r, run_dir = ray_run_with_restart
    assert r.returncode == 0, r.output[-4000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{cluster.storage}/mlflow.db")
    run = client.get_run(json.loads((run_dir / "tracking.json").read_text())["mlflow"]["run_id"])
    assert len(client.search_runs([run.info.experiment_id])) == 1 and run.info.status == "FINISHED"
    assert run.data.tags["trainapp.launcher"] == "ray" and run.data.tags["trainapp.attempts"] == "2"
    kept: dict[int, tuple[float, int]] = {}
    for rec in metrics(run_dir):  # the final lineage: a restart drops what it trains again
        if rec["kind"] == "start":
            kept = {s: v for s, v in kept.items() if s <= (rec.get("resumed_step") or 0)}
        elif rec["kind"] == "train":
            kept[rec["step"]] = (rec["loss"], int(rec["time"] * 1000))
    assert sorted(kept) == [5, 10, 15, 20, 24]
    got = sorted((m.step, (m.value, m.timestamp)) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert got == sorted(kept.items())


def test_the_snapshot_write_delay_drill_slows_every_ray_snapshot(ray_run_with_restart):
    r, run_dir = ray_run_with_restart
    blocking = [s["blocking_s"] for s in metrics(run_dir, "snapshot")]
    assert len(blocking) >= 5 and min(blocking) >= DRILL_DELAY_S, blocking


def test_ray_and_torchrun_end_with_the_same_parameters(ray_run_with_restart, torchrun_straight):
    """Accumulation, EMA and evaluation included, a worker killed and the group restarted by Ray Train:
    the parameters of torchrun's run never stopped."""
    r, run_dir = ray_run_with_restart
    assert r.returncode == 0, r.output[-4000:]
    assert inspect(run_dir)["params_sha256"] == inspect(torchrun_straight)["params_sha256"]


def test_a_user_task_not_shipped_stops_in_the_driver_before_any_worker(cluster):
    """The user's package is on no node and the job does not ship it: one line from the driver."""
    missing = run_cmd(submit_cmd(cluster, "usertask-unshipped", *USER_TASK), timeout=120, env=cluster.env())
    assert missing.returncode != 0
    assert ("trainapp ray: error: task.name='tabular_task:Regression': cannot import tabular_task"
            in missing.output)
    assert "Started training worker group" not in missing.output  # the driver's preflight, before any worker


@pytest.mark.e2e
def test_char_lm_sharded_resumes_a_killed_worker_from_every_shard_to_torchruns_parameters_and_reshards_on_one(
        cluster, tmp_path):
    """The built-in language model under Ray with parallel.strategy=fsdp and a URI `ray.storage_path`
    (file://, the cloud store's path through pyarrow): every worker uploads its own shards, rank 0 the
    rest, and registers the snapshot with Ray. Rank 1 SIGKILLed after step 13; the restarted group
    downloads the snapshot, loads every worker's shard and ends bitwise where torchrun's straight FSDP run
    does. Resubmitted on one worker (a node lost for good), the two-rank snapshot is resharded and the run
    goes on. And a script of the user's own, shipped with --working-dir, hands Ray its task object
    (`trainapp.fit_ray`). (DDP's killed worker under Ray: tests/test_ray_resume.py; FSDP on a shared
    filesystem path is torchrun's layout, tests/test_fsdp.py.)"""
    lm = ["parallel.strategy=fsdp", "task.name=char_lm", "task.args.n_embd=32", "task.args.n_layer=1",
          "task.args.block_size=32", "task.args.stride=64", "train.batch_size=16", "train.max_steps=24",
          "train.epochs=20", "snapshot.every_steps=5", "train.progress=false", "train.log_every=5",
          "snapshot.memory_every_steps=0"]
    store, run_dir = tmp_path / "bucket", tmp_path / "run"
    lm += [f"ray.storage_path=file://{store}", f"run.dir={run_dir}"]
    r = submit(cluster, "char-lm", *lm, "drill.kill_at_step=13", "drill.rank=1")
    assert r.returncode == 0, r.output[-4000:]
    assert "val_bpc=" in r.output and [s["resumed_step"] for s in metrics(run_dir, "start")] == [None, 10]
    final = store / "char-lm" / "step_000000024"
    meta = json.loads((final / "meta.json").read_text())
    # Both workers' shards (torch.distributed.checkpoint's `__RANK_0.distcp`) are in the directory Ray holds.
    assert sorted(meta["shards"]) == ["shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"], meta
    assert all((final / f).stat().st_size == v["bytes"] for f, v in meta["shards"].items())
    record = json.loads((store / "char-lm" / "checkpoint_manager_snapshot.json").read_text())
    assert final.name in [r["checkpoint_dir_name"] for r in record["checkpoint_results"]], record
    assert not list(Path(tempfile.gettempdir()).glob("trainapp-resume-*"))  # the resume's download is gone
    t = torchrun(2, f"run.dir={tmp_path / 'tr'}", *lm[:-2])
    assert t.returncode == 0, t.output[-3000:]
    assert inspect(final)["params_sha256"] == inspect(tmp_path / "tr")["params_sha256"]
    # The end-of-run export of the sharded model, gathered a parameter at a time, uploaded beside the
    # snapshots on the URI store: the same tensors as torchrun's run exported at its end.
    exported = json.loads((store / "char-lm" / "model" / "trainapp.json").read_text())
    assert exported["step"] == 24 and exported["source"]["kind"] == "sharded snapshot", exported
    assert (exported["tensors_sha256"]
            == json.loads((tmp_path / "tr" / "model" / "trainapp.json").read_text())["tensors_sha256"])
    assert not (run_dir / "model").exists()  # the local copy went once uploaded
    r = submit(cluster, "char-lm", *lm, "train.max_steps=29", "ray.num_workers=1")
    assert r.returncode == 0, r.output[-4000:]
    start = metrics(run_dir, "start")[-1]
    assert (start["resumed_step"], start["resumed_world_size"], start["world_size"]) == (24, 2, 1), start
    assert sorted(json.loads((store / "char-lm" / "step_000000029" / "meta.json").read_text())["shards"]) == \
        ["shards/.metadata", "shards/__0_0.distcp"]
    script = ("import trainapp; from tabular_task import Regression; "
              f"s = trainapp.fit_ray(Regression(hidden=16), overrides=['ray.storage_path={cluster.storage}', "
              "'ray.name=script', 'train.max_steps=10', 'train.progress=false']); print('steps', s['step'])")
    cmd = [RAY, "job", "submit", "--address", cluster.dashboard_url, "--working-dir", "examples/tabular",
           "--", "python", "-c", script]
    r = run_cmd(cmd, timeout=400, env=cluster.env())
    assert r.returncode == 0 and "steps 10" in r.output, r.output[-4000:]
    (start,) = metrics(cluster.storage / "script", "start")
    assert start["config"]["task"] == {"name": "tabular_task.task:Regression", "args": {}}


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    stat = proc_stat(pid)
    return stat is not None and stat[1][0] != "Z"


@pytest.mark.e2e
def test_an_out_of_memory_rank_then_a_hung_rank_are_explained_and_the_ray_run_ends_as_if_neither_happened(
        cluster, torchrun_straight):
    """Rank 1 raises torch.OutOfMemoryError after step 8 (attempt 0), then hangs after step 17
    (attempt 1): each time its peer is gone within seconds (its own watch, or Ray Train's controller
    stopping the group first), Ray Train restarts the group from the newest snapshot, and the run ends
    with the parameters of the same run without these faults (FAULT_RUN under torchrun). Snapshots are
    written in the background and registered with Ray at the next report (the last one at the end of
    the run)."""
    name = "failures"
    run_dir = cluster.storage / name
    # 15 s, not less: rank 0 waits in Ray Train's report barrier at the final snapshot, which took 6 s
    # with a second suite running beside this one, and a silence that long is a hang (5 s fired there).
    proc = submit_background(cluster, name, *FAULT_RUN, "train.log_every=1", "drill.oom_at_step=8",
                             "drill.hang_at_step=17", "drill.rank=1", "fault.hang_timeout_s=15",
                             "ray.max_failures=2", "snapshot.async=true")
    try:
        gone = []  # per attempt: seconds from rank 1's failure record until rank 0's process was gone
        for attempt in (0, 1):
            failed = wait_for_record(run_dir, "failure", lambda f: f["rank"] == 1 and f["attempt"] == attempt)
            rank0 = metrics(run_dir, "start")[attempt]["pid"]  # rank 0 writes each attempt's start record
            while _alive(rank0) and time.time() - failed["time"] < 30:
                time.sleep(0.05)
            gone.append(time.time() - failed["time"])
    finally:
        rc, out = finish(proc)
    if rc != 0:  # pytest shows a failed test's printed output whole, where it cuts a long message short
        kinds = ("start", "failure", "hang", "group_failure")
        print(*(json.dumps(r) for r in metrics(run_dir) if r["kind"] in kinds), out[-6000:], sep="\n")
    assert rc == 0, [(r["kind"], r.get("attempt"), r.get("rank"), r.get("cause")) for r in metrics(run_dir)
                     if r["kind"] in ("failure", "group_failure")]
    assert "trainapp ray: done steps=24" in out and "val_acc=" in out, out[-3000:]
    assert max(gone) < 10, gone
    by_attempt: dict[int, dict[int, dict]] = {}
    for f in metrics(run_dir, "failure"):
        by_attempt.setdefault(f["attempt"], {})[f["rank"]] = f
    oom, hang = by_attempt[0][1], by_attempt[1][1]
    assert (oom["cause"], oom["step"], oom["memory"]["device"]) == ("oom", 8, "cpu"), oom
    assert (hang["cause"], hang["step"], hang["phase"]) == ("hang", 17, "data"), hang
    assert (run_dir / "hangs" / "rank-1-attempt-1.txt").exists()
    for attempt in (0, 1):  # rank 0 says why it left, unless Ray's controller stopped it first
        peer = by_attempt[attempt].get(0)
        assert peer is None or peer["cause"] in ("peer", "hang"), peer
    assert [s["resumed_step"] for s in metrics(run_dir, "start")] == [None, 5, 15]
    assert inspect(run_dir)["params_sha256"] == inspect(torchrun_straight)["params_sha256"]
    rep = trainapp("report", str(run_dir), timeout=120)
    assert "failures       2" in rep.stdout and "attempt 1: rank 1 on" in rep.stdout, rep.output


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")
def test_a_failed_upload_to_uri_storage_is_a_failed_snapshot_and_the_final_one_stops_the_run(cluster,
                                                                                             tmp_path):
    """`ray.storage_path` a URI (file:// on a 1.2 MB tmpfs, room for one snapshot): rank 0 uploads, the
    second upload hits ENOSPC and is counted like a full local disk (training goes on, nothing partial
    stays), the failed final one stops the run with one line and no retry (ray.max_failures=0). With
    snapshot.async the upload runs in the writer's thread and its failure is counted at the next save:
    the same records, the same line (the OOM-and-hang test covers async registration with Ray)."""
    mount = tmp_path / "bucket"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)], check=True)
    try:
        run_dir = tmp_path / "run"
        r = submit(cluster, "uri", "train.max_steps=30", "train.epochs=10", "snapshot.every_steps=10", *QUICK,
                   f"run.dir={run_dir}", "ray.max_failures=0", f"ray.storage_path=file://{mount}",
                   "snapshot.async=true")
        stored = sorted(p.name for p in (mount / "uri").iterdir() if p.name.startswith("step_"))
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
    assert r.returncode != 0, r.output[-4000:]
    failed = metrics(run_dir, "snapshot_failed", missing_ok=True)
    assert [(f["step"], f["errno"]) for f in failed] == [(20, "ENOSPC"), (30, "ENOSPC")], r.output[-4000:]
    assert failed[0]["path"] == f"file://{mount}/uri/step_000000020"
    assert stored == ["step_000000010"]  # the partial uploads were deleted
    # One line (`ray job submit` shows the job's last lines twice: streamed, then in its status).
    errors = sorted({line for line in r.output.splitlines() if line.startswith("trainapp ray: error:")})
    assert (len(errors) == 1
            and "the final snapshot (step 30) failed: [Errno 28] No space left on device" in errors[0])
    assert f"free space under file://{mount}/uri" in errors[0] and "ray.storage_path" in errors[0], errors
    assert f"the newest valid snapshot is {mount}/uri/step_000000010" in errors[0], errors
    assert [f["cause"] for f in metrics(run_dir, "failure")] == ["storage", "storage"]
    assert {s["background"] for s in metrics(run_dir, "snapshot")} == {True}


def test_bad_ray_input_fails_fast_with_one_line(cluster, tmp_path):
    cases = {
        "no cluster": (["ray.address=127.0.0.1:1"], "ray.address=127.0.0.1:1: no Ray cluster answers"),
        "min > max": (["ray.num_workers=[3,1]"], "ray.num_workers=[3, 1]"),
        "global batch under the workers": (["ray.num_workers=[1,4]", "train.batch_size=32",
                                            "train.global_batch=64"],
                                           "train.global_batch=64: 2 micro-batch(es)"),
        "too many workers": ([f"ray.address={cluster.address}", "ray.num_workers=5",
                              f"ray.storage_path={tmp_path}"], "can hold at most 2 workers"),
        "unwritable storage": ([f"ray.address={cluster.address}", "ray.storage_path=/proc/trainapp-store"],
                               "ray.storage_path=/proc/trainapp-store: not writable"),
        "interface on no node": ([f"ray.address={cluster.address}", f"ray.storage_path={tmp_path}",
                                  "network.interface=nosuch0"], "network.interface=nosuch0: host "),
        # A built-in task is made in the workers (the driver imports no torch): the same one line comes back.
        # (Ray Train retries a worker group's bad input like any failure, up to ray.max_failures times.)
        "built-in task args": ([f"ray.address={cluster.address}", f"ray.storage_path={tmp_path}",
                                "task.name=char_lm", "task.args.bogus=1", "ray.max_failures=0"],
                               "task.args={'bogus': 1}: char_lm cannot be called with them"),
    }
    for name, (args, needle) in cases.items():
        t0 = time.monotonic()
        r = trainapp("ray", *args, timeout=300, env=cluster.client_env(), fresh=True)  # a Ray client
        elapsed = time.monotonic() - t0
        one_error_line(r, "ray", needle)
        # Not a speed figure: the failure this guards against is Ray Train retrying the bad group or waiting
        # out its start timeouts (many minutes). The start itself takes 20-80 s on a busy 2-core machine,
        # over 150 s on Ray 2.55 beside CI's container and Slurm smokes.
        assert elapsed < 240, (name, elapsed)
        if name == "built-in task args":
            # The workers' tracebacks and Ray Train's account of them stay in Ray's session logs (the
            # driver's own native lines, if any, are not the run's and are not counted).
            assert "RayTrainWorker" not in r.output and "TrainController" not in r.output, r.stderr[-3000:]
            assert ("Ray's " in r.stderr
                    and " lines about it are in the session logs (" in r.stderr), r.stderr[-3000:]


@pytest.mark.e2e
def test_a_lost_node_shrinks_the_run_and_a_returning_one_grows_it_back_with_every_sample_once(cluster):
    """An elastic run of a user's task (its items carry their index, its loss writes down what each rank
    trained at each step) loses a worker node (its raylet SIGKILLed): the run goes on on the other
    node with the same global batch; then a node comes back and Ray Train grows the group to two
    again: the workers snapshot the step reached first, so the grow-back redoes nothing. Over the
    whole run every sample of every epoch is trained exactly once (redone steps after the lost node
    count once: the attempt that went on). A stream of 8 JSON Lines shards (its 2 lanes move between
    the ranks), `ray.storage_path` a URI (the workers read the resize controller's requests on the
    store); map-style data: tests/test_elastic.py. Leaves two worker nodes for the tests after."""
    name, rows, gb = "elastic", 1024, 32
    run_dir = cluster.storage / name
    victim, newcomer = cluster.nodes[-1].name, f"worker{len(cluster.nodes)}"
    proc = subprocess.Popen(
        submit_cmd(cluster, name, "task.name=usertasks_stream:StreamLedger", f"task.args.rows={rows}",
                    "task.args.step_s=0.1", "train.batch_size=16", "train.epochs=10", "train.max_steps=300",
                    "snapshot.every_steps=20", "train.progress=false", "train.log_every=1", "amp.dtype=off",
                    "ray.num_workers=[1,2]", "ray.resize_check_s=5",
                    f"ray.storage_path=file://{cluster.storage}/uri", f"run.dir={run_dir}",
                    ship="tests/usertasks"),
        cwd=REPO, env=cluster.env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:  # a node killed and not replaced (the test failed first): conftest.py heals the cluster after it
        wait_for_step(run_dir, 12, 480, gone=exited(proc))  # a first job on a busy machine starts slowly
        os.kill(cluster.node_pids(victim)["raylet"], signal.SIGKILL)
        wait_for_record(run_dir, "train", lambda r: r["world_size"] == 1)
        time.sleep(5)  # some steps on one worker
        returned = time.time()
        cluster.join_worker(newcomer, 3, cwd=REPO)  # the head, worker1 and the newcomer
        grown = wait_for_record(run_dir, "train", lambda r: r["world_size"] == 2 and r["time"] > returned)
        print(f"node returned to training on 2 workers: {grown['time'] - returned:.1f} s")
    finally:
        rc, out = finish(proc, timeout=600)
        print(f"the job's output, exit {rc}:\n{out[-6000:]}")  # pytest shows it when the test fails
    assert rc == 0, out[-4000:]
    # The lost node: the new group was sized for the one node left, without waiting out the start
    # timeout (NodeLossWatch found the raylet silent and waited for Ray to declare the node dead, or found
    # it dead already; either way it had the cluster view re-read).
    assert "startup timed out" not in out
    watched = ("stopped answering" in out and "declared dead after" in out) or "already declared dead" in out
    assert watched, out[-4000:]
    starts = metrics(run_dir, "start")
    assert [s["world_size"] for s in starts] == [2, 1, 2], starts
    assert {s["global_batch"] for s in starts} == {gb} and starts[1]["layout"]["micro_steps"] == [2]
    # The grow-back: the resize snapshot is the step the bigger group resumed from.
    resized = one_record(run_dir, "resized", out)
    assert resized["by"] == "resize from 1 to 2 workers", resized
    assert starts[2]["resumed_step"] == resized["step"], (resized, starts[2])
    assert f"step {resized['step']} snapshotted" in out, out[-4000:]
    # Equal shards, 2 lanes of 512 items: every epoch is 32 whole steps.
    ledger = usertasks_stream.epochs_once(run_dir, rows, 32)
    assert ledger == {"steps": list(range(1, 301)), "sizes": {gb}, "bad_epochs": []}, ledger
    published = inspect(cluster.storage / "uri" / name)  # the URI store holds the snapshots
    assert published["world_size"] == 2 and published["global_step"] == 300


@pytest.mark.e2e
def test_drained_worker_node_snapshots_at_once_and_the_restart_resumes_from_it(cluster):
    """A drain for preemption (what the autoscaler and our pods' preStop send) reaches the loop through
    ray.train.get_preemption_info, asked about every `preempt.ray_poll_s` seconds at a step the workers
    agree on: a snapshot at once and at every poll while the drain lasts, training goes on; then the node
    dies and the elastic restart resumes from the last of them (periodic snapshots off: nothing else could
    serve it). On a Ray without drain notices (before 2.58, trainapp/launch/ray/private/versions.py) the
    driver says so in one line, the loop hears nothing, and the restart resumes from the start."""
    from trainapp.launch.ray.private import versions

    run_dir = cluster.storage / "drained"
    poll_s = 0.5
    submitted_ms = time.time() * 1000  # the cluster ran other jobs before this one
    # Steps of 25 ms or more (rank 0 sleeps): the node dies before the end on a fast CPU too (400 steps of 33
    # ms once ended before a late notice); without notices, a restart trains them all again (epoch: 8 steps)
    steps, sid = (1500 if versions.drain_notices() else 600), f"drained-{uuid.uuid4().hex[:8]}"
    proc = submit_background(cluster, "drained", *KILLABLE_RUN, f"train.max_steps={steps}",
                             "train.epochs=200", "snapshot.every_steps=0", "drill.slow_rank=0",
                             "drill.slow_ms=25", f"preempt.ray_poll_s={poll_s}",
                             "ray.num_workers=[1,2]", "ray.worker_group_start_timeout_s=15", sid=sid,
                             stop_wait_s=60)  # the stop at the end: time to record it (3 s on Ray 2.55)
    # Ray's IDs of the nodes, asked before the run: the state API can take seconds to answer beside it.
    node_ids = {n["node_ip"]: n["node_id"] for n in cluster.state("nodes", state="ALIVE") or []}
    victim = None
    try:
        # 8 steps of both workers (on a busy cluster an elastic run may start on one and grow): the node
        # drained is then one of the group Ray Train's preemption watcher follows.
        wait_until(lambda: steps_at_world_size(run_dir, 2) >= 8, "8 steps of a 2-worker group", 240)
        time.sleep(4 * poll_s)  # polls by time alone would have come by now
        undrained_ms = time.time() * 1000
        # The node of this run's last rank.
        victim = node_of(cluster, metrics(run_dir, "start")[-1]["placement"][-1]["pid"])
        ip = next(n.ip for n in cluster.nodes if n.name == victim)
        assert ip in node_ids, f"{victim} ({ip}) is not among the nodes Ray's state API listed: {node_ids}"
        node_id = node_ids[ip]
        asked_s = time.time()
        drain = run_cmd([RAY, "drain-node", "--address", cluster.address, "--node-id", node_id,
                         "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "test: spot reclaim",
                         "--deadline-remaining-seconds", "120"], env=cluster.env(), timeout=60)
        assert drain.returncode == 0, drain.output
        drained_s = time.time()
        with contextlib.suppress(AssertionError):  # the Rays without drain notices write none
            wait_until(lambda: metrics(run_dir, "drain_notice"), "a drain notice",
                       60 if versions.drain_notices() else 6 * poll_s, interval=0.1)
        notices = metrics(run_dir, "drain_notice")
        assert bool(notices) == versions.drain_notices(), \
            f"no drain_notice record within 60 s of the drain of {victim} ({node_id}); last record: " \
            f"{metrics(run_dir)[-1]}; groups: {[r['world_size'] for r in metrics(run_dir, 'start')]}"
        if notices:  # four polls into the drain, counted (no periodic snapshots): loaded, a barrier took 7 s
            wait_until(lambda: len(metrics(run_dir, "snapshot")) >= 4, "4 drain-time snapshots", 120)
        else:  # time for a notice to come where none should
            time.sleep(6 * poll_s)
        os.kill(cluster.node_pids(victim)["raylet"], signal.SIGKILL)
        # The restart's first step is all the rest asks: stopped there, not trained on (400 s on a slow CPU).
        wait_until(lambda: steps_at_world_size(run_dir, 1) >= 1, "a step of the restarted group", 240)
        stopping = time.monotonic()  # under load the head (nice 10) can take long: checked, and the time said
        stop = run_cmd([RAY, "job", "stop", "--address", cluster.dashboard_url, sid], 240, cluster.env())
        assert stop.returncode == 0, f"ray job stop: {stop.output[-2000:]}"
        print(f"ray job stop took {time.monotonic() - stopping:.1f} s")
    finally:
        try:
            rc, out = finish(proc)
        finally:
            if victim is not None:  # drained; killed already unless the test failed first (conftest.py heals)
                with contextlib.suppress(KeyError, ProcessLookupError):
                    os.kill(cluster.node_pids(victim)["raylet"], signal.SIGKILL)
    assert ["ray job stop" in r["by"] for r in metrics(run_dir, "stopped")] == [True], out[-4000:]
    if not versions.drain_notices():
        assert sum("no drain notices reach the training loop" in line
                   for line in out.splitlines()) == 1, out[-3000:]
        assert metrics(run_dir, "start")[-1]["world_size"] == 1 and not metrics(run_dir, "drain_notice")
        return
    # Until a drain, no rank asked Ray (a barrier of every worker through Ray Train's synchronization
    # actor): no broadcast went through it, though `poll_s` passed many times.
    broadcasts = cluster.state("tasks", name="SynchronizationActor.broadcast_from_rank_zero") or []
    assert broadcasts, "Ray's state API lists no broadcast at all: the drain's polls should be there"
    early = [t for t in broadcasts if submitted_ms <= t.get("creation_time_ms", submitted_ms) < undrained_ms]
    assert not early, early[:2]
    notice = notices[0]
    # The deadline given (120 s from the moment `ray drain-node` sent it) less the time since, however late
    # the notice came (21 s after the drain once, on a 2-core Xeon beside make test-e2e's other lane).
    since = (notice["time"] - drained_s, notice["time"] - asked_s)
    assert notice["nodes"] == [node_id] and 119 - since[1] <= notice["deadline_in_s"] <= 121 - since[0], since
    records = metrics(run_dir)
    noticed = next(i for i, r in enumerate(records) if r["kind"] == "drain_notice")
    starts = [i for i, r in enumerate(records) if r["kind"] == "start" and i > noticed]
    assert starts, f"no restart: the run ended before the node died ({records[-1]})"
    first_start = starts[0]  # the restart's
    trained = {r["step"]: r["time"] for r in records[:first_start] if r["kind"] == "train"}
    snaps = [r["step"] for r in records[:first_start] if r["kind"] == "snapshot"]
    assert notice["step"] in snaps, (notice, snaps)
    # The polls, and so the drain-time snapshots, go by time: each interval holds about `poll_s` of training
    # (plus up to a vote interval) from the end of the last poll's barrier, so (the median, as one barrier
    # can stall under load) at least two steps: polls at every step would make it one.
    drain_snaps = [step for step in snaps if step >= notice["step"]]
    assert len(drain_snaps) >= 4, (notice, snaps)
    gaps_s = [trained[b] - trained[a] for a, b in zip(drain_snaps, drain_snaps[1:])]
    assert min(gaps_s) >= 0.8 * poll_s and median(gaps_s) <= poll_s + StopVote.INTERVAL_S + 1.0, gaps_s
    assert median([b - a for a, b in zip(drain_snaps, drain_snaps[1:])]) >= 2, drain_snaps
    before, resumed = redone_steps(run_dir)
    # A drain-time snapshot (rank 0 may die between writing one and recording it: the last one
    # written need not have a record), so at most one poll interval of training is lost.
    assert resumed >= notice["step"] and resumed in trained, (resumed, notice, snaps)
    assert (trained[before] - trained[resumed]
            <= poll_s + StopVote.INTERVAL_S + 1.0), (before, resumed, trained)
    assert metrics(run_dir, "start")[-1]["world_size"] == 1


@pytest.mark.e2e
def test_ray_job_stop_snapshots_the_step_reached_and_the_resubmission_redoes_none(cluster, tmp_path):
    """A 2-worker run (fixed: an elastic one may start on one worker when the cluster is busy, and is then
    another computation than torchrun's at 2; bench/ray_stop.py stops elastic runs): a second
    submission of its name while it runs stops in seconds naming the first
    (the driver holds the run's lease: trainapp/snapshots/lease.py). Then `ray job stop` between two
    periodic snapshots: the driver asks the workers through the lease, they stop at one step with a
    snapshot registered with Ray and a `stopped` record, and the job ends well before Ray's wait runs
    out. The resubmission takes the released lease, resumes at that step, redoes none, and ends bitwise
    equal to a run never stopped (torchrun's, the same math). Both submissions log to one MLflow run
    (an MLflow store), each step once."""
    name, sid = "graceful", f"graceful-{uuid.uuid4().hex[:6]}"
    run_dir = cluster.storage / name
    args = (*KILLABLE_RUN, "train.epochs=100", "train.max_steps=200", "snapshot.every_steps=100",
            "ray.num_workers=2")
    # Steps of 1 s (a sleep: the numbers do not change): beside a torchrun, a second driver took over 100 s.
    slow = ("drill.slow_rank=0", "drill.slow_ms=1000")
    track = f"observe.mlflow_uri=sqlite:///{cluster.storage}/mlflow-stop.db"
    r = run_cmd(submit_cmd(cluster, name, *args, *slow, track, sid=sid, wait=False, stop_wait_s=60),
                env=cluster.env())
    assert r.returncode == 0, r.output
    wait_for_step(run_dir, 5)
    holder = json.loads((run_dir / "lease" / "gen-000000001.json").read_text())["holder"]
    second = submit(cluster, name, *args, *slow)
    assert second.returncode != 0, second.output[-3000:]
    assert f"is in use by another run: ray pid {holder['pid']} on host" in second.output, \
        second.output[-3000:]
    assert "Traceback" not in second.output
    assert len(metrics(run_dir, "start")) == 1 and not (run_dir / "lease" / "gen-000000002.json").exists()

    t0 = time.monotonic()
    stop = run_cmd([RAY, "job", "stop", "--address", cluster.dashboard_url, sid], env=cluster.env(),
                   timeout=120)
    took = time.monotonic() - t0
    assert stop.returncode == 0, stop.output
    logs = run_cmd([RAY, "job", "logs", "--address", cluster.dashboard_url, sid], env=cluster.env()).output
    assert took < 50, (took, logs[-3000:])  # it ended by itself, not at Ray's SIGKILL 60 s after the stop
    stopped = metrics(run_dir, "stopped")
    assert len(stopped) == 1 and "ray job stop" in stopped[0]["by"], (stopped, logs[-3000:])
    at = stopped[0]["step"]
    assert 5 <= at < 200 and inspect(run_dir)["global_step"] == at  # the snapshot of the step it stopped at
    assert not metrics(run_dir, "failure") and not metrics(run_dir, "preempted")
    assert f"stopped (ray job stop (SIGTERM to the job's driver)) at step {at}" in logs, logs[-3000:]
    assert f"trainapp ray: stopped (ray job stop (SIGTERM to the job's driver)) at step {at};" in logs
    # Every worker ended normally: no worker died, so Ray Train did not start the group again.
    assert ("Training failed due to worker errors" not in logs
            and "before this attempt" not in logs), logs[-4000:]

    r = submit(cluster, name, *args, track)
    assert r.returncode == 0, r.output[-4000:]
    start = metrics(run_dir, "start")[-1]
    assert start["resumed_step"] == at and start["lease"]["generation"] == 2
    assert start["lease"]["took_over"] is None  # released at the stop
    assert start["config_changes"] == {"drill.slow_ms": [1000.0, 100.0], "drill.slow_rank": [0, None]}
    steps = [m["step"] for m in metrics(run_dir, "train")]
    assert len(steps) == len(set(steps)) and max(steps) == 200  # zero steps redone
    control = tmp_path / "control"
    assert torchrun(2, f"run.dir={control}", *args).returncode == 0
    assert inspect(run_dir)["params_sha256"] == inspect(control)["params_sha256"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=track.split("=", 1)[1])
    run = client.get_run(json.loads((run_dir / "tracking.json").read_text())["mlflow"]["run_id"])
    assert len(client.search_runs([run.info.experiment_id])) == 1 and run.info.status == "FINISHED"
    assert run.data.tags["trainapp.attempts"] == "2" and run.data.tags["trainapp.launcher"] == "ray"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == sorted(steps)
    assert run.data.params[f"drill.slow_ms/resumed_at_{at}"] == "100.0"  # the resubmission's change


@pytest.mark.e2e
def test_doctor_comm_as_a_ray_job_measures_the_pair_of_worker_nodes(cluster):
    # 1 TB/s: no link reaches it, so the pair is named (exit 0 with no bar is test_comm.py's, under torchrun).
    r = run_cmd([RAY, "job", "submit", "--address", cluster.dashboard_url, "--", "python", "-m", "trainapp",
                 "doctor", "--comm", "--size-mb=1", "--iters=2", "--min-bandwidth=1000",
                 f"ray.storage_path={cluster.storage}", "ray.name=comm"], timeout=300, env=cluster.env())
    assert r.returncode != 0, r.output[-4000:]
    # Both local worker nodes have the machine's host name: Ray's node ranks tell them apart.
    head = next(line for line in r.output.splitlines() if line.startswith("comm  gloo across 2 node(s)"))
    assert "#node0" in head and "#node1" in head, head
    pair = next(line for line in r.output.splitlines() if line.startswith("pair  "))
    assert float(pair.split()[4]) > 0 and "below --min-bandwidth 1000 GB/s" in pair, pair
    assert "FAIL  comm  pair " in r.output and "doctor --comm: 1 problem(s)" in r.output, r.output[-4000:]


@pytest.mark.e2e
def test_stop_jobs_a_head_pods_prestop_stops_a_running_job_with_its_snapshot(cluster):
    """`trainapp stop-jobs`, the RayJob head pod's preStop (KubeRay terminates a deleted or suspended
    RayJob's pods without stopping its Ray job): the running job is stopped as by `ray job stop`, its
    workers snapshot the step they reached, and the command returns once the job has ended."""
    name, sid = "prestop", f"prestop-{uuid.uuid4().hex[:6]}"
    run_dir = cluster.storage / name
    args = (*KILLABLE_RUN, "train.epochs=100", "train.max_steps=300", "drill.slow_rank=0",
            "drill.slow_ms=250")
    r = run_cmd(submit_cmd(cluster, name, *args, sid=sid, wait=False, stop_wait_s=60), env=cluster.env())
    assert r.returncode == 0, r.output
    wait_for_step(run_dir, 5)
    r = trainapp("stop-jobs", "--address", cluster.dashboard_url, "--wait-s", "60", env=cluster.env(),
                 fresh=True)  # a Ray client
    assert r.returncode == 0, r.output
    # any job a test left running too
    asked = next(ln for ln in r.stdout.splitlines() if "job(s) to stop" in ln)
    assert sid in asked.rsplit(": ", 1)[1].split(", "), r.output
    stopped = metrics(run_dir, "stopped")
    assert len(stopped) == 1 and inspect(run_dir)["global_step"] == stopped[0]["step"], stopped
    status = run_cmd([RAY, "job", "status", "--address", cluster.dashboard_url, sid],
                     env=cluster.env()).output
    assert "stopped" in status.lower()
