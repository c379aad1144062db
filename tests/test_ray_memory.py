"""A Ray worker node lost with its memory, on a local cluster whose worker nodes each have a memory of
their own (devtools/local_ray.py's `node_memory`: a private tmpfs on /dev/shm per node, gone with the
node's processes). The memory tier keeps each rank's copies on its node and a buddy's on the other
node; the replacement node has nothing, and its worker takes the lost rank's state from the buddy's
copy (`peer`), reading no snapshot from storage. (The same on one node, a worker SIGKILLed:
tests/test_ray_resume.py; a lost torchrun host in network namespaces: tests/test_memory.py.)"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from helpers import REPO, inspect, metrics, torchrun2, wait_for_step, wait_until
from ray_jobs import KILLABLE_RUN, finish, start_cluster, stop_cluster, submit_background

from devtools.local_ray import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs per Ray node: needs root")]


@pytest.fixture(scope="module")
def separate_memories(tmp_path_factory):
    """A head and two worker nodes of 1 CPU, each worker node with 256 MiB of memory of its own; the
    test loses one worker node and adds another."""
    c = start_cluster(node_memory="256m")
    c.storage = tmp_path_factory.mktemp("storage")
    try:
        yield c
    finally:
        stop_cluster(c)


def _memory_of(c: LocalCluster, name: str) -> Path:
    """The node's /dev/shm, seen from outside its mount namespace (through its raylet's root)."""
    return Path(f"/proc/{c.node_pids(name)['raylet']}/root/dev/shm")


def _live_workers(c: LocalCluster) -> list[str]:
    return [n.name for n in c.nodes[1:] if "raylet" in c.node_pids(n.name)]


def _records_on(c: LocalCluster, nodes: list[str], local: Path) -> dict[str, Path]:
    """{node: its own run directory, seen from outside} for each of `nodes` whose run directory has
    records."""
    found = {n: _memory_of(c, n) / local.relative_to("/dev/shm") for n in nodes}
    return {n: p for n, p in found.items() if (p / "metrics.jsonl").exists()}


def test_a_lost_rank_0_node_resumes_from_its_buddys_memory_copy_bitwise(separate_memories, straight_sha):
    """The node of rank 0 lost with its memory, `ray.storage_path` a URI and `run.dir` each node's own
    (in the node's private /dev/shm, as a node-local disk): the memory tier's run id cannot be kept in
    `run.dir`, where a rank 0 started on another node would not find it; it is the lease's (one per
    submission). A copy every step, storage snapshots every 50 (none in a 40-step run): only memory can
    serve the resume. The survivor's node held its own rank's copies and the lost rank's buddy copies;
    the new group, one rank on the survivor and one on the empty replacement, takes the lost rank's state
    from the buddy's copy (`peer`), redoes at most one of the steps rank 0 recorded and ends bitwise
    equal to torchrun's straight run; the finished run's copies are gone from both nodes' memories. (One
    run covers what was two: a lost rank-1 node with `run.dir` on shared storage asks nothing of the
    buddy that this does not.)"""
    c = separate_memories
    store, local = c.storage / "bucket", Path("/dev/shm") / f"ta-uri-run-{os.getpid()}"
    # Rank 0 sleeps 50 ms a step (the numbers do not change) so the kill lands mid-run.
    proc = submit_background(c, "uri-memory", *KILLABLE_RUN, "snapshot.every_steps=50",
                             "snapshot.memory_every_steps=1", "drill.slow_rank=0", "drill.slow_ms=50",
                             f"ray.storage_path=file://{store}", f"run.dir={local}")
    try:
        workers = _live_workers(c)
        ((victim, first),) = wait_until(lambda: list(_records_on(c, workers, local).items()) or None,
                                        "rank 0's records on its node", timeout=240)
        survivor = next(n for n in workers if n != victim)
        wait_for_step(first, 12)
        assert metrics(first, "start")[0]["placement"][0]["pid"] in c.node_pids(victim).values()
        held = sorted(p.name for p in _memory_of(c, survivor).glob("trainapp-*/run-*/*"))
        seen = max(r["step"] for r in metrics(first, "train"))  # the lost node's records go with it
        os.killpg(next(n.pid for n in c.nodes if n.name == victim), signal.SIGKILL)
        c.join_worker("replacement", 3, cwd=REPO)
    finally:
        rc, out = finish(proc)
        shutil.rmtree(local, ignore_errors=True)  # the driver's, on the head
    assert rc == 0, out[-4000:]
    assert any(n.startswith("own-") for n in held) and any(n.startswith("peer-") for n in held), held
    runs = _records_on(c, _live_workers(c), local)
    starts = [s for p in runs.values() for s in metrics(p, "start")]
    assert len(starts) == 1 and starts[0]["resumed_tier"] == "peer", starts
    assert set(starts[0]["resumed_tiers"]) <= {"memory", "peer"}, starts
    # At most one step redone: the buddy's copy is at most one step behind what rank 0 had recorded.
    assert starts[0]["resumed_step"] >= max(seen - 1, 12), (seen, starts)
    final = store / "uri-memory" / "step_000000040"
    assert inspect(final)["params_sha256"] == straight_sha(torchrun2, *KILLABLE_RUN)
    for name in (survivor, "replacement"):
        assert not list(_memory_of(c, name).glob("trainapp-*/run-*")), name
