"""The spare worker processes' bookkeeping (trainapp/launch/ray/spares.py) without a cluster: which process
of a job becomes a spare (one that takes a claim), what it imports, how idle spares are counted, and what
is cleaned up. `_here` (the job's folder on this node, from Ray's runtime context) is a test folder here;
tests/test_ray_resume.py runs spares on a real cluster (Ray starts them, a restarted group runs in them,
the job's end ends them)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from trainapp.launch.ray import driver, node_memory, spares

GIB = 2**30
ROOMY = node_memory.Memory(used=1 * GIB, total=64 * GIB)


@pytest.fixture
def here(tmp_path, monkeypatch):
    folder = tmp_path / "job" / "node"
    monkeypatch.setattr(spares, "_here", lambda: folder)
    monkeypatch.delenv(spares.READY, raising=False)
    return folder


def _not_yet_imported(*names: str) -> str:
    for name in names:
        assert name not in sys.modules, name
    return ",".join(names)


def test_a_process_that_takes_a_claim_imports_the_modules_and_is_idle_until_taken(here, monkeypatch):
    monkeypatch.setenv(spares.PRELOAD, _not_yet_imported("xml.dom.pulldom", "no_such_module_anywhere"))
    spares.want(here, 2)
    before = time.time()
    spares.preload()  # the module that does not import is left to the worker's own import: no error here
    assert "xml.dom.pulldom" in sys.modules
    assert len(list(here.glob("want-*"))) == 1  # one claim per process
    assert [p.name for p in here.glob("spare-*")] == [f"spare-{os.getpid()}"]
    assert spares.idle(here) == 1
    ready = spares.taken()  # a training worker now runs in it
    assert ready is not None and before <= ready <= time.time()
    assert spares.idle(here) == 0 and spares.READY not in os.environ
    assert spares.taken() is None  # once


def test_a_process_ray_starts_for_a_worker_takes_no_claim_and_imports_nothing(here, monkeypatch):
    monkeypatch.setenv(spares.PRELOAD, _not_yet_imported("xml.dom.expatbuilder"))
    spares.preload()  # no folder yet
    here.mkdir(parents=True)
    spares.preload()  # a folder without claims
    old = here / "want-old"
    old.touch()
    os.utime(old, (time.time() - spares.CLAIM_S - 1,) * 2)
    spares.preload()  # a stale claim: dropped, not taken
    assert "xml.dom.expatbuilder" not in sys.modules
    assert list(here.iterdir()) == [] and spares.READY not in os.environ


def test_only_the_training_workers_env_makes_a_spare_and_the_hook_never_raises(here, monkeypatch):
    spares.want(here, 1)
    monkeypatch.delenv(spares.PRELOAD, raising=False)
    spares.preload()  # the controller, a probe, any other process of the job
    assert len(list(here.glob("want-*"))) == 1
    monkeypatch.setenv(spares.PRELOAD, "json")

    def no_ray():
        raise RuntimeError("Ray is not initialized")

    monkeypatch.setattr(spares, "_here", no_ray)
    spares.preload()  # Ray ends a process whose hook raises: this one returns
    assert spares.READY not in os.environ


def test_idle_counts_the_spares_alive_and_forgets_the_dead(here):
    here.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (here / f"spare-{os.getpid()}").touch()
    (here / f"spare-{gone.pid}").touch()
    assert spares.idle(here) == 1
    assert [p.name for p in here.iterdir()] == [f"spare-{os.getpid()}"]


def test_a_top_up_asks_for_what_the_node_lacks_and_prunes_old_jobs(here, monkeypatch):
    from trainapp.launch.ray.private import prestart

    asked = []
    monkeypatch.setattr(prestart, "prestart", lambda n, keep_s: asked.append((n, keep_s)))
    old_job = here.parent.parent / "0a000000"
    (old_job / "node").mkdir(parents=True)
    long_job = here.parent.parent / "0c000000"  # as old, but a spare of its own still waits
    (long_job / "node").mkdir(parents=True)
    (long_job / "node" / f"spare-{os.getpid()}").touch()
    for job in (old_job, long_job):
        os.utime(job, (time.time() - spares.PRUNE_S - 1,) * 2)
    recent_job = here.parent.parent / "0b000000"
    recent_job.mkdir()
    monkeypatch.setattr(spares, "root", lambda: here.parent.parent)
    assert spares.top_up(3, spares.KEEP_S, ROOMY) == 3
    assert spares.top_up(3, spares.KEEP_S, ROOMY) == 0  # three claims pending: their processes are starting
    for claim in list(here.glob("want-*"))[:2]:
        claim.unlink()  # two spares took theirs, one of them is idle and one was taken since
    (here / f"spare-{os.getpid()}").touch()
    assert spares.top_up(3, spares.KEEP_S, ROOMY) == 1
    assert asked == [(3, spares.KEEP_S), (1, spares.KEEP_S)]
    assert not old_job.exists() and recent_job.exists() and long_job.exists()


def test_a_top_up_asks_only_for_the_spares_the_nodes_memory_has_room_for(here, monkeypatch, capsys):
    """The KubeRay pods of the container smoke (a 3 GiB limit, a training worker of 1.4 GiB) had Ray's
    memory monitor end the training worker once a spare started beside it: a spare is asked for only where
    it fits below Ray's kill line, with `MARGIN` to spare, at the memory's peak; fewer is said in a line."""
    from trainapp.launch.ray.private import prestart

    asked = []
    monkeypatch.setattr(prestart, "prestart", lambda n, keep_s: asked.append(n))
    monkeypatch.setattr(spares, "root", lambda: here.parent.parent)
    monkeypatch.delenv(node_memory.THRESHOLD_ENV, raising=False)
    monkeypatch.delenv(node_memory.REFRESH_ENV, raising=False)
    here.mkdir(parents=True)
    (here.parent.parent / spares.COST).write_text(f"{GIB // 2}\n")  # a spare of the node said 0.5 GiB
    assert spares.cost() == GIB // 2
    pod = node_memory.Memory(used=int(2.2 * GIB), total=3 * GIB)  # 0.95 - 0.05 of 3 GiB: 2.7 GiB
    assert spares.room(pod, GIB // 2, node_memory.kill_at()) == 1
    assert spares.top_up(2, spares.KEEP_S, pod) == 1
    line = capsys.readouterr().err
    assert line.startswith("trainapp: ray.spare_workers: 1 of 2 spare process(es) on this node") \
        and "2.20 of 3.00 GiB" in line and "from 95% of it" in line and "0.50 GiB" in line, line
    for claim in here.glob("want-*"):
        claim.unlink()
    full = node_memory.Memory(used=int(2.3 * GIB), total=3 * GIB)
    assert spares.top_up(1, spares.KEEP_S, full) == 0 and asked == [1]
    assert "0 of 1 spare process(es)" in capsys.readouterr().err
    monkeypatch.setenv(node_memory.THRESHOLD_ENV, "0.99")  # the node's Ray kills later: room again
    assert spares.top_up(1, spares.KEEP_S, full) == 1 and asked == [1, 1]
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(node_memory.REFRESH_ENV, "0")  # Ray's monitor off: only the kernel's limit counts
    assert node_memory.kill_at() == 1.0


def test_a_spare_says_what_it_costs_and_the_node_memory_is_counted_as_rays_monitor_counts_it(here,
                                                                                              monkeypatch):
    monkeypatch.setattr(spares, "root", lambda: here.parent.parent)
    assert spares.cost() == spares.COST_BEFORE  # no spare on this node yet
    monkeypatch.setenv(spares.PRELOAD, "json")
    spares.want(here, 1)
    spares.preload()
    said = spares.cost()
    assert said != spares.COST_BEFORE and 0.5 * said < node_memory.private_bytes() < 2 * said
    spares.taken()
    # This machine's memory by our rule and by Ray's own, a moment apart.
    from ray._private.utils import get_used_memory

    ours = node_memory.read()
    assert abs(ours.used - get_used_memory()) < 256 * 2**20, (ours, get_used_memory())
    assert 0 < ours.used < ours.total


@pytest.mark.parametrize("version", [1, 2])
def test_the_node_memory_of_a_container_is_its_cgroups_less_file_cache_against_its_limit(tmp_path, version):
    """Ray's rule, on the files of a container's memory cgroup (v1 and v2), as Ray reads them."""
    if version == 1:
        (tmp_path / "memory").mkdir()
        files = {"memory/memory.usage_in_bytes": 3000, "memory/memory.limit_in_bytes": 8000,
                 "memory/memory.stat": "cache 9\ntotal_inactive_file 500\ntotal_active_file 300\n"}
    else:
        files = {"memory.current": 3000, "memory.max": 8000,
                 "memory.stat": "anon 2000\ninactive_file 500\nactive_file 300\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(f"{text}\n")
    assert node_memory.read(tmp_path) == node_memory.Memory(used=2200, total=8000)
    if version == 2:
        (tmp_path / "memory.max").write_text("max\n")  # no limit: the machine's memory
        import psutil

        assert node_memory.read(tmp_path) == node_memory.Memory(2200, psutil.virtual_memory().total)


def test_the_driver_reads_the_jobs_own_setup_hook(monkeypatch):
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert driver._job_hook() is None
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {"env_vars": {"A": "1"}}}')
    assert driver._job_hook() is None
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR",
                       '{"runtime_env": {"worker_process_setup_hook": "mypkg.setup"}}')
    assert driver._job_hook() == "mypkg.setup"


def test_a_spares_imports_leave_cuda_alone():
    """A spare imports before Ray gives it a GPU (CUDA_VISIBLE_DEVICES is set when a training worker starts
    in it): an import that asked CUDA for its devices would fix them to the node's all. In a fresh
    interpreter, none of the preloaded modules asks."""
    from trainapp.launch.ray.setup import PRELOADS, train_worker

    code = f"""
import torch
asked = []
real = torch._C._cuda_getDeviceCount
torch._C._cuda_getDeviceCount = lambda: asked.append(1) or real()
for name in {list(PRELOADS[train_worker])!r}:
    __import__(name)
print(len(asked), torch.cuda.is_initialized())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["0", "False"], out.stdout + out.stderr
