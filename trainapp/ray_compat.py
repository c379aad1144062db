"""Every use of Ray's private API in trainapp, in one module, for the Ray versions in
trainapp.ray_checks.SUPPORTED.

Ray Train's public API carries the training itself (TorchTrainer, ScalingConfig, RunConfig,
FailureConfig, CheckpointConfig, `ray.train.report` / `get_checkpoint`, WorkerGroupError and
ControllerError). What it has no public way to do, and what each one uses here:

- Run code on every worker before Ray Train creates the process group: the network interface must
  be exported by then (trainapp/net.py), or the group forms on the wrong interface or hangs. Ray's
  torch backend is what runs there, so `TorchConfigWithSetup` subclasses it (reached through the
  public `TorchConfig.backend_cls`) and calls a setup function in its `on_start`. runtime_env's
  `worker_process_setup_hook` cannot replace it: Ray runs that hook only from a job-level runtime
  env, in every process of the job (the Train controller too, not just the training workers), and a
  hook that fails ends its process without the error reaching the driver.
- Two controller settings trainapp exposes (`ray.worker_group_start_timeout_s`,
  `ray.health_check_interval_s`) and the preemption watcher's poll interval: Ray Train's controller
  reads them only from environment variables (`controller_env`), which no config object carries.
- See a lost node before an elastic restart is sized (`NodeLossWatch`): that needs the controller's
  failure decision and the worker group's start, which only the private ControllerCallback and
  WorkerGroupCallback offer (the public UserCallback sees reports and exceptions only), and the Ray
  Data autoscaling coordinator whose cluster view sizes the new group.
- Leave out Ray Data for a run without Ray datasets (`TorchTrainer`): Ray Train starts a
  DatasetManager actor at every worker-group start whether there are datasets or not, and only its
  private default-callback list can drop it.

`check_version()` (in ray_checks, which imports no Ray, so it can run first) stops the Ray driver
with one line on a Ray outside SUPPORTED; tests/test_ray_compat.py imports every name in
PRIVATE_NAMES, so an upgrade that moves one of them fails there, by name.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from trainapp.config import ConfigError
from trainapp.ray_checks import SUPPORTED

PRIVATE_NAMES = [
    ("ray.train.torch.config", "_TorchBackend"),
    ("ray.train.v2._internal.execution.callback", "ControllerCallback"),
    ("ray.train.v2._internal.execution.callback", "WorkerGroupCallback"),
    ("ray.train.v2._internal.execution.failure_handling", "FailureDecision"),
    ("ray.train.v2._internal.execution.scaling_policy.elastic", "ElasticScalingPolicy"),
    ("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator", "get_or_create_autoscaling_coordinator"),
    ("ray.train.v2._internal.constants", "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR"),
    ("ray.train.v2._internal.constants", "HEALTH_CHECK_INTERVAL_S_ENV_VAR"),
    ("ray.train.v2._internal.constants", "PREEMPTION_POLL_INTERVAL_S_ENV_VAR"),
    ("ray.train.v2._internal.callbacks.datasets", "DatasetsCallback"),
]
"""(module, name) of every private Ray name used here; the tests import each one."""


try:  # an import error here is a Ray version trainapp was not written for, said in one line
    import ray
    from ray.train.torch import TorchConfig
    from ray.train.torch import TorchTrainer as _TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.constants import (
        HEALTH_CHECK_INTERVAL_S_ENV_VAR,
        PREEMPTION_POLL_INTERVAL_S_ENV_VAR,
        WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
    )
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
except ImportError as e:
    raise ConfigError(f"ray: cannot import a name trainapp needs ({e}); trainapp's Ray launcher was written for "
                      f"Ray >={SUPPORTED[0]},<{SUPPORTED[1]} (trainapp/ray_compat.py)") from None


PREEMPTION_POLL_S = 1.0
"""How often Ray Train's preemption watcher asks the GCS for drained nodes (Ray's default: 5 s). A
notice often gives 30 s in all; one small GCS request a second spends less of it."""


def controller_env(worker_group_start_timeout_s: float, health_check_interval_s: float) -> dict[str, str]:
    """The environment that sets Ray Train's controller's worker-group start timeout, poll interval and
    drain-watch interval (the driver's environment is propagated to the controller)."""
    return {WORKER_GROUP_START_TIMEOUT_S_ENV_VAR: str(worker_group_start_timeout_s),
            HEALTH_CHECK_INTERVAL_S_ENV_VAR: str(health_check_interval_s),
            PREEMPTION_POLL_INTERVAL_S_ENV_VAR: str(PREEMPTION_POLL_S)}


# ----------------------------------------------------------------------------------------------
# Code on every worker before the process group


class _BackendWithSetup(TorchConfig().backend_cls):
    def on_start(self, worker_group, backend_config: TorchConfigWithSetup) -> None:
        if backend_config.setup is not None:
            worker_group.execute(backend_config.setup, **backend_config.setup_kwargs)
        super().on_start(worker_group, backend_config)


@dataclasses.dataclass
class TorchConfigWithSetup(TorchConfig):
    """Ray's TorchConfig whose backend first runs `setup(**setup_kwargs)` on every worker, before it
    creates the process group. An exception there ends the run as a ControllerError whose
    `controller_failure` carries it."""

    setup: Callable[..., Any] | None = None
    setup_kwargs: dict = dataclasses.field(default_factory=dict)

    @property
    def backend_cls(self):
        return _BackendWithSetup


# ----------------------------------------------------------------------------------------------
# A lost node seen before an elastic restart


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

    def after_worker_group_start(self, worker_group) -> None:
        self._nodes = {w.metadata.node_id for w in worker_group.get_workers()}

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        if failure_decision != FailureDecision.RETRY or not self._nodes or self.wait_s <= 0:
            return
        try:  # an error raised here would count as a training failure: report it and carry on
            self._settle()
        except Exception as e:
            _say(f"could not check the workers' nodes before the restart ({e.__class__.__name__}: {e})")

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
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        # A recompute re-reads the nodes and re-reserves for every requester; the requester id is ours.
        coordinator = get_or_create_autoscaling_coordinator()
        ray.get(coordinator.get_reserved_resources.remote("trainapp-node-loss-watch", recompute=True), timeout=10)
        # The elastic policy caches the coordinator's answer briefly, and last asked before t0.
        time.sleep(max(0.0, ElasticScalingPolicy.GET_RESERVED_RESOURCES_INTERVAL_S - (time.monotonic() - t0)))
        when = f"declared dead after {time.monotonic() - t0:.1f}s" if lost else "already declared dead"
        _say(f"node {names} {when}; restarting on the nodes that are left")

    def _wait_until_dead(self, lost: dict[str, str]) -> bool:
        """Until Ray has declared every node of `lost` dead (True), or `wait_s` has passed (False)."""
        names = ", ".join(f"{ip} ({nid[:8]})" for nid, ip in lost.items())
        _say(f"node {names} stopped answering; waiting up to {self.wait_s:.0f}s (ray.node_loss_wait_s) for Ray "
             "to declare it dead, so the restart is sized for the nodes that are left")
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.wait_s:
            if not any(n.get("Alive") for n in ray.nodes() if n["NodeID"] in lost):
                return True
            time.sleep(self.poll_s)
        _say(f"node {names} is still alive to Ray after {self.wait_s:.0f}s; restarting anyway")
        return False



# ----------------------------------------------------------------------------------------------
# The trainer


class TorchTrainer(_TorchTrainer):
    """Ray's TorchTrainer without Ray Data's callback when the run has no Ray datasets (trainapp's
    never has: each rank builds its own shard). That callback starts a DatasetManager actor at every
    worker-group start, datasets or not: a fresh Python process that imports Ray Data and pandas,
    about 1.4 s of CPU beside the training workers' own imports at every start and restart (docs/ray.md,
    "Start-up and recovery: where the seconds go"). A run given datasets keeps it."""

    def _create_default_callbacks(self):
        callbacks = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        return [cb for cb in callbacks if not isinstance(cb, DatasetsCallback)]
