"""A Ray worker node lost with its memory, on a local cluster whose worker nodes each have a memory of
their own (devtools/local_ray.py's `node_memory`: a private tmpfs on /dev/shm per node, gone with the
node's processes). The memory tier keeps each rank's copies on its node and a buddy's on the other
node; the replacement node has nothing, and its worker takes the lost rank's state from the buddy's
copy (`peer`), reading no snapshot from storage. (The same on one node, a worker SIGKILLed:
tests/test_ray_resume.py; a lost torchrun host in network namespaces: tests/test_memory.py.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers import REPO, inspect, metrics, torchrun2, wait_for_step
from ray_jobs import (KILLABLE_RUN, finish, redone_steps, start_cluster, stop_cluster, submit_background,
                      training_worker_pids)

from devtools.local_ray import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs per Ray node: needs root")]


@pytest.fixture
def separate_memories(tmp_path):
    """A head and two worker nodes of 1 CPU, each worker node with 256 MiB of memory of its own."""
    c = start_cluster(node_memory="256m")
    c.storage = tmp_path / "storage"
    try:
        yield c
    finally:
        stop_cluster(c)


def _memory_of(c: LocalCluster, name: str) -> Path:
    """The node's /dev/shm, seen from outside its mount namespace (through its raylet's root)."""
    return Path(f"/proc/{c.node_pids(name)['raylet']}/root/dev/shm")


def test_a_lost_ray_node_resumes_from_its_buddys_memory_copy_bitwise(separate_memories, straight_sha):
    c = separate_memories
    run_dir = c.storage / "lost-memory"
    # A copy every step, storage snapshots only every 50 (none in a 40-step run): only memory can serve
    # the resume. Rank 0 sleeps 50 ms a step (the numbers do not change) so the kill lands mid-run.
    proc = submit_background(c, "lost-memory", *KILLABLE_RUN, "snapshot.every_steps=50",
                             "snapshot.memory_every_steps=1", "drill.slow_rank=0", "drill.slow_ms=50")
    try:
        pids = training_worker_pids(run_dir)
        victim = next(n.name for n in c.nodes if pids[1] in c.node_pids(n.name).values())
        survivor = next(n.name for n in c.nodes[1:] if n.name != victim)
        wait_for_step(run_dir, 12)
        held = sorted(p.name for p in _memory_of(c, survivor).glob("trainapp-*/run-*/*"))
        os.killpg(next(n.pid for n in c.nodes if n.name == victim), signal.SIGKILL)
        c.add_worker("replacement", REPO)
        c.wait_for_nodes(3, 120)
    finally:
        rc, out = finish(proc)
    assert rc == 0, out[-4000:]
    # The survivor's node held its own rank's copies and the buddy copies of the lost node's rank.
    assert any(n.startswith("own-") for n in held) and any(n.startswith("peer-") for n in held), held
    before, resumed = redone_steps(run_dir)
    assert before - resumed <= 1 and resumed < 40, (before, resumed)
    start = metrics(run_dir, "start")[1]
    assert start["resumed_tier"] == "peer" and sorted(start["resumed_tiers"]) == ["memory", "peer"], start
    assert inspect(run_dir)["params_sha256"] == straight_sha(torchrun2, *KILLABLE_RUN)
    # The finished run's copies are gone from both nodes' memories.
    for name in (survivor, "replacement"):
        assert not list(_memory_of(c, name).glob("trainapp-*/run-*")), name
