"""A lost node seen before an elastic restart is sized: `NodeLossWatch`, a callback in Ray Train's
controller.

What Ray has no public way to do: see a lost node before the restart is sized. That needs the
controller's failure decision and the worker group's start, which only the private ControllerCallback
and WorkerGroupCallback offer (callbacks.py), and the Ray Data autoscaling coordinator whose cluster view
sizes the new group, re-read the way this Ray allows (versions.py).

Private names: `FailureDecision` (`ray.train.v2._internal.execution.failure_handling`), the decision
the controller's failure hook is handed.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from trainapp.launch.ray.private import say, unsupported
from trainapp.launch.ray.private.callbacks import ControllerCallback, WorkerGroupCallback

PRIVATE_NAMES = (
    ("ray.train.v2._internal.execution.failure_handling", "FailureDecision"),
)
"""(module, name) of every private Ray name used here; tests/test_ray_compat.py imports each one."""

try:  # an import error here is a Ray version trainapp was not written for, said in one line
    import ray
    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    from trainapp.launch.ray.private import versions
except ImportError as e:
    raise unsupported(e, __name__) from None

if TYPE_CHECKING:
    from trainapp.launch.ray.private.callbacks import WorkerGroup


def raylet_answers(ip: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class NodeLossWatch(ControllerCallback, WorkerGroupCallback):
    """A callback in Ray Train's controller, for elastic runs (a fixed-size group needs its lost node
    back either way).

    When a worker group fails, the controller restarts it at once and sizes an elastic group from the
    cluster view of Ray Data's AutoscalingCoordinator, which re-reads the node list only every few
    seconds. A node whose raylet has just died is still alive in that view (the GCS declares it dead
    only after its health checks fail), so the restart asks for the old size, one worker can never
    start, and the group waits out `ray.worker_group_start_timeout_s` before a smaller retry.

    Before a restart this probes the raylet of every node that hosted a worker; if one does not
    answer, it waits (at most `wait_s`) until the GCS has declared that node dead, then has the
    coordinator re-read the cluster, so the restart is sized for the nodes that are left. A node the
    GCS declared dead before the failure surfaced can still be in the coordinator's view: it is
    re-read then too. A worker that died on a live node costs one probe per node and no wait.
    """

    def __init__(self, wait_s: float, probe_timeout_s: float = 1.0, poll_s: float = 0.25):
        self.wait_s, self.probe_timeout_s, self.poll_s = wait_s, probe_timeout_s, poll_s
        self._nodes: set[str] = set()

    def after_worker_group_start(self, worker_group: WorkerGroup) -> None:
        self._nodes = {w.metadata.node_id for w in worker_group.get_workers()}

    def before_controller_execute_failure_decision(self, failure_decision: FailureDecision) -> None:
        if failure_decision != FailureDecision.RETRY or not self._nodes or self.wait_s <= 0:
            return
        try:  # an error raised here would count as a training failure: report it and carry on
            self._settle()
        except Exception as e:
            say(f"could not check the workers' nodes before the restart ({e.__class__.__name__}: {e})")

    def _lost_nodes(self, hosts: list[dict]) -> dict[str, str]:
        """{node id: address} of the alive-to-Ray `hosts` whose raylet does not answer."""
        with ThreadPoolExecutor(max(1, len(hosts))) as pool:
            answers = list(pool.map(lambda n: raylet_answers(n["NodeManagerAddress"], n["NodeManagerPort"],
                                                             self.probe_timeout_s), hosts))
        return {n["NodeID"]: n["NodeManagerAddress"] for n, ok in zip(hosts, answers) if not ok}

    def _settle(self) -> None:
        nodes = [n for n in ray.nodes() if n["NodeID"] in self._nodes]
        # Declared dead already (the failure surfaced after Ray's health checks): nothing to wait for,
        # but the coordinator's view may still count the node, so it is refreshed all the same.
        dead = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes if not n.get("Alive")}
        lost = self._lost_nodes([n for n in nodes if n.get("Alive")])
        if not lost and not dead:
            return
        t0 = time.monotonic()
        if lost and not self._wait_until_dead(lost):
            return
        names = ", ".join(f"{ip} ({nid[:8]})" for nid, ip in {**dead, **lost}.items())
        if versions.cluster_reread():  # else the driver said what is lost; the coordinator refreshes itself
            versions.reread_cluster("trainapp-node-loss-watch")
        # The elastic policy caches the coordinator's answer briefly, and last asked before t0.
        time.sleep(max(0.0, versions.RESERVED_CACHE_S - (time.monotonic() - t0)))
        when = f"declared dead after {time.monotonic() - t0:.1f}s" if lost else "already declared dead"
        say(f"node {names} {when}; restarting on the nodes that are left")

    def _wait_until_dead(self, lost: dict[str, str]) -> bool:
        """Until Ray has declared every node of `lost` dead (True), or `wait_s` has passed (False)."""
        names = ", ".join(f"{ip} ({nid[:8]})" for nid, ip in lost.items())
        say(f"node {names} stopped answering; waiting up to {self.wait_s:.0f}s (ray.node_loss_wait_s) for "
             "Ray to declare it dead, so the restart is sized for the nodes that are left")
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.wait_s:
            if not any(n.get("Alive") for n in ray.nodes() if n["NodeID"] in lost):
                return True
            time.sleep(self.poll_s)
        say(f"node {names} is still alive to Ray after {self.wait_s:.0f}s; restarting anyway")
        return False
