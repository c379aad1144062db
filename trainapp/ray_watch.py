"""A lost node noticed before the restart: a callback in Ray Train's controller.

When a worker group fails, Ray Train's controller restarts it at once and sizes an elastic group
from the cluster view of Ray Data's AutoscalingCoordinator, which re-reads the node list every 20 s.
A node whose raylet has just died is still alive in that view (the GCS declares it dead only after
its health checks fail), so the restart asks for the old size, one worker can never start, and the
group waits out `ray.worker_group_start_timeout_s` before a smaller retry, sometimes twice.

`NodeLossWatch` runs in the controller. Before a restart it probes the raylet of every node that
hosted a worker; if one does not answer, it waits (at most `ray.node_loss_wait_s`) until the GCS has
declared that node dead, then has the coordinator re-read the cluster, so the restart is sized for
the nodes that are left. A worker that died on a live node costs one probe per node, no wait.
"""

from __future__ import annotations

import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.failure_handling import FailureDecision
from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy


def _say(msg: str) -> None:
    # The controller's stdout reaches the job's log (`ray job logs`) prefixed with its actor name.
    print(f"trainapp: {msg}", file=sys.stderr, flush=True)


def raylet_answers(ip: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class NodeLossWatch(ControllerCallback, WorkerGroupCallback):
    """Installed for elastic runs only: a fixed-size group needs its lost node back either way."""

    def __init__(self, wait_s: float, probe_timeout_s: float = 1.0, poll_s: float = 0.25):
        self.wait_s, self.probe_timeout_s, self.poll_s = wait_s, probe_timeout_s, poll_s
        self._nodes: set[str] = set()

    def after_worker_group_start(self, worker_group) -> None:
        self._nodes = {w.metadata.node_id for w in worker_group.get_workers()}

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        if failure_decision != FailureDecision.RETRY or not self._nodes or self.wait_s <= 0:
            return
        try:  # an error raised here would count as a training failure: report it and carry on
            self._settle()
        except Exception as e:
            _say(f"could not check the workers' nodes before the restart ({e.__class__.__name__}: {e})")

    def _settle(self) -> None:
        hosts = [n for n in ray.nodes() if n["NodeID"] in self._nodes and n.get("Alive")]
        with ThreadPoolExecutor(max(1, len(hosts))) as pool:
            answers = list(pool.map(lambda n: raylet_answers(n["NodeManagerAddress"], n["NodeManagerPort"],
                                                             self.probe_timeout_s), hosts))
        lost = {n["NodeID"]: n["NodeManagerAddress"] for n, ok in zip(hosts, answers) if not ok}
        if not lost:
            return
        names = ", ".join(f"{ip} ({nid[:8]})" for nid, ip in lost.items())
        _say(f"node {names} stopped answering; waiting up to {self.wait_s:.0f}s (ray.node_loss_wait_s) for Ray "
             "to declare it dead, so the restart is sized for the nodes that are left")
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.wait_s:
            if not any(n.get("Alive") for n in ray.nodes() if n["NodeID"] in lost):
                break
            time.sleep(self.poll_s)
        else:
            _say(f"node {names} is still alive to Ray after {self.wait_s:.0f}s; restarting anyway")
            return
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        # A recompute re-reads the nodes and re-reserves for every requester; the requester id is ours.
        coordinator = get_or_create_autoscaling_coordinator()
        ray.get(coordinator.get_reserved_resources.remote("trainapp-node-loss-watch", recompute=True), timeout=10)
        # The elastic policy caches the coordinator's answer for a second, and last asked before t0.
        time.sleep(max(0.0, ElasticScalingPolicy.GET_RESERVED_RESOURCES_INTERVAL_S - (time.monotonic() - t0)))
        _say(f"node {names} declared dead after {time.monotonic() - t0:.1f}s; restarting on the nodes that are left")
