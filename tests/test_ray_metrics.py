"""Live metrics under Ray (trainapp/launch/ray/metrics.py): a real local cluster with Ray's metrics export
on (`ray start --metrics-export-port`), a real `ray job submit`, and the trainapp figures read from the
node's metrics export over HTTP on loopback, as Ray's Prometheus scrape reads them."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import pytest
from helpers import QUICK, REPO
from test_live_metrics import scrape

from devtools.local_ray import RAY, LocalCluster
from helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture
def metrics_cluster():
    # One worker node with both training workers: one metrics export to read.
    c = LocalCluster(Path(f"/tmp/ta-raym-{uuid.uuid4().hex[:8]}"), workers=1, cpus=2, gcs_port=free_port(),
                     dashboard_port=free_port(), metrics=True)
    try:
        c.up(cwd=REPO)
        yield c
    finally:
        c.down(grace=5)
        subprocess.run(["rm", "-rf", str(c.dir)], check=False)


def test_each_workers_figures_reach_the_nodes_ray_metrics_export_while_the_job_trains(metrics_cluster,
                                                                                      tmp_path):
    c, name, sid = metrics_cluster, "live", f"live-{uuid.uuid4().hex[:8]}"
    node = next(n for n in c.nodes if n.name == "worker1")
    # A run far longer than the test watches it (3000 steps of at least 60 ms): the job is stopped once the
    # figures have moved, so how often Ray's agents report and how loaded the machine is cannot end the
    # run before two reports were read (seen in CI with a run that trained by itself to the end).
    job = subprocess.Popen([RAY, "job", "submit", "--address", c.dashboard_url, "--submission-id", sid, "--",
                            "python", "-m", "trainapp", "ray", f"ray.storage_path={tmp_path}",
                            f"ray.name={name}", "train.max_steps=3000", "train.epochs=1000",
                            "snapshot.every_steps=500", "drill.slow_rank=1", "drill.slow_ms=60", *QUICK],
                           cwd=REPO, env=c.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    seen, deadline = [], time.monotonic() + 240
    try:
        while job.poll() is None and time.monotonic() < deadline:
            # The agent serves every Ray metric of the node: on a loaded machine it may take seconds.
            s = scrape(node.metrics_port, timeout=15) or {}
            # Ray adds its own labels (session, worker, ...): look the samples up by name and our labels.
            ours = {k: v for k, v in s.items() if k[0].startswith("ray_trainapp_")}
            if ours:
                seen.append(ours)
            if len({_one(o, "ray_trainapp_step") for o in seen} - {None}) >= 2:
                break
            time.sleep(1)
    finally:
        subprocess.run([RAY, "job", "stop", "--address", c.dashboard_url, sid], env=c.env(),
                       capture_output=True, timeout=120, check=False)
        out = job.communicate(timeout=300)[0]
    steps = [_one(o, "ray_trainapp_step") for o in seen]
    assert len(set(steps) - {None}) >= 2, (steps, out[-2000:])  # values move as the run goes
    last = seen[-1]
    assert ({_label(k, "rank") for k in last if k[0] == "ray_trainapp_rank_step_seconds"}
            == {"0", "1"}), last.keys()
    assert (_one(last, "ray_trainapp_total_steps") == 3000
            and _one(last, "ray_trainapp_samples_per_second") > 0)


def _label(key: tuple, name: str) -> str | None:
    return dict(key[1]).get(name)


def _one(samples: dict, name: str) -> float | None:
    """The value of `name` (one series: the run's figures come from rank 0 only)."""
    vals = [v for k, v in samples.items() if k[0] == name]
    assert len(vals) <= 1, (name, vals)
    return vals[0] if vals else None
