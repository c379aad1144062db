"""What tests/test_ray.py and tests/test_ray_resume.py share: the runs they submit and the helpers that
submit them to the local Ray cluster (conftest.py's `cluster`) through a real `ray job submit`, wait for
their end and read what Ray Train did. A job that outlives its timeout is SIGKILLed by its session, as
helpers.run_cmd does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from helpers import REPO, communicate, end_session, free_port, metrics, run_cmd, wait_for_step

from devtools.local_ray import RAY, LocalCluster

KILLABLE_RUN = ["train.max_steps=40", "train.epochs=20", "snapshot.every_steps=5", "train.progress=false",
                "train.log_every=1", "data.train_size=1024", "data.val_size=256",
                "snapshot.memory_every_steps=0"]
"""A run long enough to be killed in the middle: per-step records, a snapshot every 5 steps. A Ray run
resumed by the storage tier (the memory tier's resumes: its own test turns it on over this)."""

USER_TASK = ["task.name=tabular_task:Regression", "task.args.hidden=32", "task.args.train_rows=2048",
             "optim.name=adamw", "optim.lr=0.003", "train.max_steps=24", "train.epochs=20",
             "snapshot.every_steps=5", "train.progress=false", "train.log_every=5", "train.eval_every=10"]
"""examples/tabular's task, on no node's path: a job must ship it (`--working-dir`)."""


def start_cluster(**options) -> LocalCluster:
    """A head and two worker nodes of 1 CPU on free ports (`options`: more LocalCluster fields); gone
    again if the start fails."""
    # A short directory: Ray's socket paths must stay under the OS limit.
    c = LocalCluster(Path(f"/tmp/ta-ray-{uuid.uuid4().hex[:8]}"), workers=2, cpus=1, gcs_port=free_port(),
                     dashboard_port=free_port(), **options)
    try:
        # 300 s: under `make test`'s two workers the head's job agent can take minutes to register.
        c.up(timeout=300, cwd=REPO)
    except BaseException:
        stop_cluster(c)
        raise
    return c


def stop_cluster(c: LocalCluster) -> None:
    c.down(grace=5)
    subprocess.run(["rm", "-rf", str(c.dir)], check=False)


def submit_cmd(cluster, name: str, *args: str, sid: str | None = None, wait: bool = True,
               ship: str | None = None, stop_wait_s: int | None = None) -> list[str]:
    """`ray job submit` of `python -m trainapp ray` named NAME on the cluster's storage, with `args`."""
    env = ["--runtime-env-json", json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(stop_wait_s)}})] \
        if stop_wait_s else []
    return [RAY, "job", "submit", "--address", cluster.dashboard_url,
            *(["--working-dir", ship] if ship else []), *(["--submission-id", sid] if sid else []),
            *([] if wait else ["--no-wait"]), *env, "--", "python", "-m", "trainapp", "ray",
            f"ray.storage_path={cluster.storage}", f"ray.name={name}", *args]


def submit(cluster, name: str, *args: str, timeout: float = 400):
    return run_cmd(submit_cmd(cluster, name, *args), timeout=timeout, env=cluster.env())


def submit_background(cluster, name: str, *args: str, **submit: Any) -> subprocess.Popen:
    cmd = submit_cmd(cluster, name, *args, **submit)
    return subprocess.Popen(cmd, cwd=REPO, env=cluster.env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, str]:
    """(exit code, output) of a `ray job submit` started by `submit_background`, once it ends. Called from
    a `finally` while the test's own error is on its way out, it does not wait for the job: it SIGKILLs
    the submit's session and returns, so that error is the one reported (conftest.py stops the job and
    heals the cluster after the test), not a wait of `timeout` for a job that trains on."""
    if sys.exc_info()[1] is not None:
        out, _ = end_session(proc)
        return proc.returncode, out or ""
    out, _ = communicate(proc, timeout, f"job did not finish in {timeout}s:")
    return proc.returncode, out


def training_worker_pids(run_dir: Path, workers: int = 2) -> list[int]:
    """The training workers' PIDs by rank, from the placement in the run's first start record, once the
    run has trained its first step. Not from Ray's state API: its dashboard runs on the head, which
    yields to training (nice 10), and can take seconds to answer beside it; a run of 40 steps may be
    over by then."""
    wait_for_step(run_dir, 1)
    pids = [p["pid"] for p in metrics(run_dir, "start")[0]["placement"]]
    assert len(pids) == workers and all(Path(f"/proc/{pid}").exists() for pid in pids), pids
    return pids


def signal_at_step(cluster, name: str, step: int, sig: int, *args: str) -> tuple[int, str]:
    """Submit NAME with `args`, send `sig` to its last rank once it has trained `step`, and wait for the
    job's end: (exit code of `ray job submit`, its output)."""
    run_dir = cluster.storage / name
    proc = submit_background(cluster, name, *args)
    try:
        pids = training_worker_pids(run_dir)
        wait_for_step(run_dir, step)
        os.kill(pids[-1], sig)
    finally:
        rc, out = finish(proc)
    return rc, out


def redone_steps(run_dir: Path) -> tuple[int, int]:
    """(highest step trained before the restart, step resumed from)."""
    records = metrics(run_dir)
    starts = [i for i, r in enumerate(records) if r["kind"] == "start"]
    assert len(starts) >= 2, "no restart recorded"
    before = max(r["step"] for r in records[starts[0]:starts[1]] if r["kind"] == "train")
    return before, records[starts[1]]["resumed_step"]


def one_record(run_dir: Path, kind: str, out: str) -> dict:
    """The run's one `kind` record. None or several: fails with the records' kinds (steps and evals left
    out) and the job's lines about resizes and failures, which say what happened instead."""
    found = metrics(run_dir, kind)
    kinds = [r.get("kind") for r in metrics(run_dir) if r.get("kind") not in ("train", "eval")]
    said = [line for line in out.splitlines() if "resiz" in line or "fail" in line]
    assert len(found) == 1, (kind, kinds, said[-20:])
    return found[0]


def node_of(cluster, pid: int) -> str:
    """The name of the local node whose `ray start` session holds process `pid`."""
    return next(n.name for n in cluster.nodes if pid in cluster.node_pids(n.name).values())


def steps_at_world_size(run_dir: Path, world_size: int) -> int:
    """Steps trained since the run's newest start, if that start's group has `world_size` workers; else 0."""
    records = metrics(run_dir, missing_ok=True)
    start = max((i for i, r in enumerate(records) if r["kind"] == "start"), default=None)
    if start is None or records[start]["world_size"] != world_size:
        return 0
    return sum(r["kind"] == "train" for r in records[start:])
