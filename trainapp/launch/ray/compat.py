"""Every use of Ray's private API in trainapp, in one module, for the Ray versions in
trainapp.launch.ray.checks.SUPPORTED.

Ray Train's public API carries the training itself (TorchTrainer, ScalingConfig, RunConfig,
FailureConfig, CheckpointConfig, `ray.train.report` / `get_checkpoint`, WorkerGroupError and
ControllerError). What it has no public way to do, and what each one uses here:

- Run code on every worker before Ray Train creates the process group: the network interface must
  be exported by then (trainapp/launch/net.py), or the group forms on the wrong interface or hangs. Only
  the backend of the backend config runs there, so `TorchConfigWithSetup` carries its own backend,
  which runs a setup function first. runtime_env's `worker_process_setup_hook` cannot replace it:
  Ray runs that hook only from a job-level runtime env, in every process of the job (the Train
  controller too, not just the training workers), and a hook that fails ends its process without
  the error reaching the driver.
- Keep torch out of Ray Train's controller and of the job driver: the controller unpickles the
  backend config and runs its backend, and Ray's `TorchConfig`, torch backend and `TorchTrainer` live
  in modules that import torch (seconds of CPU at the controller's start, when nothing else can run
  yet, and in the driver while the nodes' probes run). So the backend here is Ray's torch backend
  re-driven from this torch-free module: the same steps in the same order, each worker-side step
  Ray's own function, imported by name in the worker (`_in_worker`); and `TorchTrainer` is Ray's,
  made from its base class (`DataParallelTrainer`, a developer API).
- Two controller settings trainapp exposes (`ray.worker_group_start_timeout_s`,
  `ray.health_check_interval_s`) and the preemption watcher's poll interval: Ray Train's controller
  reads them only from environment variables (`controller_env`), which no config object carries.
- See a lost node before an elastic restart is sized (`NodeLossWatch`): that needs the controller's
  failure decision and the worker group's start, which only the private ControllerCallback and
  WorkerGroupCallback offer (the public UserCallback sees reports and exceptions only), and the Ray
  Data autoscaling coordinator whose cluster view sizes the new group.
- Keep the job's output to one copy of each line a worker writes: Ray Train's print patch (on by
  default) sends a worker's `print` both to the console and through its logger, so each printed line
  reached the job's output twice; its switch is an environment variable named in a private module
  (`controller_env` turns the patch off unless the driver's environment says otherwise). And Ray
  Train logs "Reporting training result N: ..." at INFO on every rank for every report, from its
  private execution-context module (`quiet_report_lines` keeps those off the console).
- Say in one line when Ray Train will refuse to resume a run (`check_run_record`): its record of the
  run's checkpoints lives in a file whose name is a private constant, and the error Ray raises when
  a checkpoint it names is gone is a private exception, raised in the controller with a traceback
  and the advice to delete the run's directory, snapshots and all.
- Ask Ray Train about a drain only when there is one (`drain_pending`): `ray.train.get_preemption_info()`
  is a barrier of every worker through the synchronization actor (rank 0's answer, broadcast), and
  the worker's own copy of the watcher's notice, which it broadcasts, is in the private train context.
- Leave out Ray Data for a run without Ray datasets (`TorchTrainer`): Ray Train starts a
  DatasetManager actor at every worker-group start whether there are datasets or not, and only its
  private default-callback list can drop it.

`check_version()` (in ray_checks, which imports no Ray, so it can run first) stops the Ray driver
with one line on a Ray outside SUPPORTED; tests/test_ray_compat.py imports every name in
PRIVATE_NAMES, so an upgrade that moves one of them fails there, by name.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

from trainapp.config import ConfigError
from trainapp.launch.ray.checks import SUPPORTED, run_store

PRIVATE_NAMES = (
    ("ray.train.torch.config", "_setup_torch_process_group"),
    ("ray.train.torch.config", "_set_torch_distributed_env_vars"),
    ("ray.train.torch.config", "_shutdown_torch"),
    ("ray.train.torch.config", "TorchConfigContextManager"),
    ("ray.train._internal.utils", "get_address_and_port"),
    ("ray.train.v2._internal.util", "TrainingFramework"),
    ("ray.train.v2._internal.execution.callback", "ControllerCallback"),
    ("ray.train.v2._internal.execution.callback", "WorkerGroupCallback"),
    ("ray.train.v2._internal.execution.failure_handling", "FailureDecision"),
    ("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator",
     "get_or_create_autoscaling_coordinator"),
    ("ray.train.v2._internal.constants", "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR"),
    ("ray.train.v2._internal.constants", "HEALTH_CHECK_INTERVAL_S_ENV_VAR"),
    ("ray.train.v2._internal.constants", "ENABLE_PRINT_PATCH_ENV_VAR"),
    ("ray.train.v2._internal.constants", "CHECKPOINT_MANAGER_SNAPSHOT_FILENAME"),
    ("ray.train.v2._internal.execution.context", "logger"),
    ("ray.train.v2._internal.execution.context", "get_train_context"),
    ("ray.train.v2._internal.callbacks.datasets", "DatasetsCallback"),
    ("ray.train.v2.api.data_parallel_trainer", "DataParallelTrainer"),
)
"""(module, name) of every private Ray name used here, in every supported Ray; the tests import each one.
The hooks only some supported Rays have are trainapp/launch/ray/versions.py's."""


try:  # an import error here is a Ray version trainapp was not written for, said in one line
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.train.backend import Backend, BackendConfig
    from ray.train.constants import (
        DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    )
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.constants import (
        CHECKPOINT_MANAGER_SNAPSHOT_FILENAME,
        ENABLE_PRINT_PATCH_ENV_VAR,
        HEALTH_CHECK_INTERVAL_S_ENV_VAR,
        WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
    )
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
    from ray.train.v2._internal.execution.context import get_train_context as _train_context
    from ray.train.v2._internal.execution.context import logger as _report_logger
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2._internal.util import TrainingFramework
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from trainapp.launch.ray import versions
except ImportError as e:
    raise ConfigError(f"ray: cannot import a name trainapp needs ({e}); trainapp's Ray launcher was written "
                      f"for Ray >={SUPPORTED[0]},<{SUPPORTED[1]} (trainapp/launch/ray/compat.py)") from None

if TYPE_CHECKING:  # Ray's types in the hooks overridden here and in resize.py: private, so named here only
    from ray.actor import ActorHandle
    from ray.train._internal.base_worker_group import BaseWorkerGroup
    from ray.train.torch.config import TorchConfigContextManager
    from ray.train.v2._internal.execution.context import TrainRunContext
    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision as ResizeDecision
    from ray.train.v2._internal.execution.worker_group import WorkerGroup
    from ray.train.v2._internal.execution.worker_group import WorkerGroupContext as WorkerGroupContext
    from ray.train.v2._internal.execution.worker_group import WorkerGroupPollStatus as WorkerGroupPollStatus
    from ray.train.v2.api.callback import RayTrainCallback


PREEMPTION_POLL_S = 1.0
"""How often Ray Train's preemption watcher asks the GCS for drained nodes (Ray's default: 5 s). A
notice often gives 30 s in all; one small GCS request a second spends less of it."""


def controller_env(worker_group_start_timeout_s: float, health_check_interval_s: float) -> dict[str, str]:
    """The environment that sets Ray Train's controller's worker-group start timeout, poll interval and
    drain-watch interval, and turns off its print patch in the workers (Ray Train hands these
    variables from the driver's environment to the controller and on to every worker). A print patch
    setting already in the driver's environment is kept."""
    env = {WORKER_GROUP_START_TIMEOUT_S_ENV_VAR: str(worker_group_start_timeout_s),
           HEALTH_CHECK_INTERVAL_S_ENV_VAR: str(health_check_interval_s),
           ENABLE_PRINT_PATCH_ENV_VAR: os.environ.get(ENABLE_PRINT_PATCH_ENV_VAR, "0")}
    if versions.PREEMPTION_POLL_INTERVAL_S_ENV_VAR:  # Ray 2.57 on
        env[versions.PREEMPTION_POLL_INTERVAL_S_ENV_VAR] = str(PREEMPTION_POLL_S)
    return env


def _no_report_info(record: logging.LogRecord) -> bool:
    return record.name != _report_logger.name or record.levelno >= logging.WARNING


def quiet_report_lines() -> None:
    """In a worker, after Ray Train configured its logging: its per-report INFO line ("Reporting
    training result N: TrainingReport(...) from rank R", one per rank per snapshot) no longer goes to
    the console, so not to the job's output. Ray Train's log files under the session's `logs/train`
    keep it. trainapp's `snapshot` records in metrics.jsonl say the same."""
    for handler in logging.getLogger("ray.train").handlers:
        # The console handler is a StreamHandler; the session's log files are handlers of their own.
        console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
        if console and _no_report_info not in handler.filters:
            handler.addFilter(_no_report_info)


# ----------------------------------------------------------------------------------------------
# Code on every worker before the process group


_TORCH_CONFIG = "ray.train.torch.config"  # Ray's torch backend: imports torch


def _in_worker(module: str, name: str, env: dict[str, str] | None = None, **kwargs: Any) -> Any:
    """In a worker: set `env`, then call Ray's `module.name(**kwargs)`, imported here, where torch is
    wanted, rather than pickled by reference from the controller, which would import it there."""
    os.environ.update(env or {})
    return getattr(importlib.import_module(module), name)(**kwargs)


class _TorchBackendWithSetup(Backend):
    """Ray's torch backend (`ray.train.torch.config._TorchBackend.on_start`/`on_shutdown`) for the
    init method "env" and a backend TorchTrainer has chosen (gloo, or nccl with GPUs), with the
    config's setup run on every worker first."""

    share_cuda_visible_devices = True  # as Ray's: each worker sees its node's GPUs

    # Ray calls a backend with the config whose `backend_cls` it is; Ray's own backends narrow it too.
    def on_start(self, worker_group: BaseWorkerGroup,  # type: ignore[override]
                 backend_config: TorchConfigWithSetup) -> None:
        if backend_config.setup is not None:
            worker_group.execute(backend_config.setup, **backend_config.setup_kwargs)
        addr, port = worker_group.execute_single(0, _in_worker, "ray.train._internal.utils",
                                                 "get_address_and_port")
        worker_group.execute(_in_worker, _TORCH_CONFIG, "_set_torch_distributed_env_vars",
                             env={"MASTER_ADDR": addr, "MASTER_PORT": str(port)})
        # Ray's worker group returns ray.types.ObjectRef, which Ray's ray.get is not annotated to take.
        ray.get([worker_group.execute_single_async(i, _in_worker, _TORCH_CONFIG, "_setup_torch_process_group",
                                                   backend=backend_config.backend, world_rank=i,
                                                   world_size=len(worker_group), init_method="env://",
                                                   timeout_s=backend_config.timeout_s)
                 for i in range(len(worker_group))])  # type: ignore[arg-type]

    def on_shutdown(self, worker_group: BaseWorkerGroup,  # type: ignore[override]  # as on_start
                    backend_config: TorchConfigWithSetup) -> None:
        futures = worker_group.execute_async(_in_worker, _TORCH_CONFIG, "_shutdown_torch",
                                             destroy_process_group=len(worker_group) > 1)
        timeout_s = float(os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                         DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))
        try:
            ray.get(futures, timeout=timeout_s)  # type: ignore[arg-type]  # as in on_start
        except GetTimeoutError:
            say(f"the torch process group did not shut down within {timeout_s:g}s")


class _TorchContext:
    """Ray's TorchConfigContextManager (around the training function, in each worker), imported only
    in the worker: the driver builds the trainer, and its module imports torch."""

    _inner: TorchConfigContextManager

    def __enter__(self) -> None:
        from ray.train.torch.config import TorchConfigContextManager

        self._inner = TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc: object) -> bool:
        return self._inner.__exit__(*exc)


@dataclasses.dataclass
class TorchConfigWithSetup(BackendConfig):
    """Ray's TorchConfig (same fields and defaults, init method "env" only) whose backend first runs
    `setup(**setup_kwargs)` on every worker, before it creates the process group, and which imports
    no torch where the controller unpickles it. An exception in `setup` ends the run as a
    ControllerError whose `controller_failure` carries it."""

    backend: str | None = None
    """The process group's backend; Ray's TorchTrainer sets it (nccl with GPUs, else gloo)."""
    timeout_s: int = 1800
    """Seconds for process-group operations to time out."""
    setup: Callable[..., Any] | None = None
    """Runs on every worker before the process group exists; must live in a module without torch."""
    setup_kwargs: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments of `setup`."""

    @property
    def backend_cls(self) -> type[_TorchBackendWithSetup]:
        return _TorchBackendWithSetup

    @property
    def train_func_context(self) -> type[_TorchContext]:
        return _TorchContext

    @property
    def framework(self) -> TrainingFramework:
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


# ----------------------------------------------------------------------------------------------
# In the training thread


def drain_pending() -> bool:
    """In a Ray Train worker's training thread: whether Ray Train's preemption watcher has told this
    worker of a drain (`mark_preempt` sets the worker's copy; `get_preemption_info()` broadcasts rank
    0's). True when that copy cannot be read (another Ray's layout): the loop then asks Ray by time,
    as it would without this check."""
    try:
        return _train_context().preemption_context.preemption_info is not None
    except (AttributeError, RuntimeError):
        return True


# ----------------------------------------------------------------------------------------------
# A lost node seen before an elastic restart


def say(msg: str) -> None:
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


# ----------------------------------------------------------------------------------------------
# The driver, before the trainer


def check_run_record(storage: str, name: str) -> None:
    """In the driver, before `fit`: ConfigError when Ray's record of the run STORAGE/NAME (a resubmission)
    names a checkpoint that is gone, which Ray Train refuses to resume (someone deleted a `step_*`
    directory, or a bucket's lifecycle rule did). A record that is missing or unreadable is left to
    Ray, whose own error says what is wrong with it (another Ray version's, say)."""
    from pyarrow.fs import FileType

    fs, run, shown = run_store(storage, name)
    try:
        with fs.open_input_stream(f"{run}/{CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}") as f:
            names = [r["checkpoint_dir_name"] for r in json.loads(f.read())["checkpoint_results"]]
    except (OSError, ValueError, KeyError, TypeError):
        return
    infos = fs.get_file_info([f"{run}/{n}" for n in names])
    gone = [n for n, info in zip(names, infos) if info.type != FileType.Directory]
    if gone:
        raise ConfigError(f"ray.name={name}: Ray's record of this run "
                          f"({shown}/{CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}) names {', '.join(gone)}, gone "
                          f"from {shown}, and Ray Train will not resume it; restore the snapshot, or move "
                          f"the record aside to resume from the newest snapshot left there (Ray forgets "
                          f"the metrics it recorded), or use a new ray.name to start afresh")


# ----------------------------------------------------------------------------------------------
# The trainer


class TorchTrainer(DataParallelTrainer):
    """Ray's TorchTrainer, made from its base class so that the driver imports no torch (Ray's
    TorchTrainer lives in a module that does: seconds of the driver's CPU on the start-up's critical
    path, while the nodes' probes want the same cores; docs/ray.md, "Start-up and recovery: where
    the seconds go"). Like Ray's, it chooses the backend (nccl with GPUs, else gloo) of its
    TorchConfigWithSetup and sets nothing else; Ray's local mode (no workers), which trainapp's
    `ray.num_workers` refuses, is left out.

    It also leaves out Ray Data's callback when the run has no Ray datasets (trainapp's never has:
    each rank builds its own shard). That callback starts a DatasetManager actor at every worker-group
    start, datasets or not: a fresh Python process that imports Ray Data and pandas, seconds of CPU
    beside the training workers' own imports at every start and restart. A run given datasets keeps it."""

    def __init__(self, train_loop_per_worker: Callable[[], Any] | Callable[[dict[str, Any]], Any], *,
                 torch_config: TorchConfigWithSetup | None = None, **kwargs: Any) -> None:
        torch_config = torch_config or TorchConfigWithSetup()
        if not torch_config.backend:
            scaling = kwargs.get("scaling_config")
            torch_config.backend = "nccl" if scaling is not None and scaling.use_gpu else "gloo"
        super().__init__(train_loop_per_worker, backend_config=torch_config, **kwargs)

    on_sigint: Callable[[], bool] | None = None
    """The driver's stop (trainapp/launch/ray/stop.py): called on Ctrl-C first; True when it handled it.
    Ray Train's own handler (abort the run, no snapshot) takes the next one."""

    def _create_default_callbacks(self) -> list[RayTrainCallback]:
        callbacks = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        return [cb for cb in callbacks if not isinstance(cb, DatasetsCallback)]

    def _register_sigint_handler(self, controller: ActorHandle[TrainController]) -> None:
        super()._register_sigint_handler(controller)  # Ray Train's: it aborts the controller
        if self.on_sigint is None:
            return
        ray_handler, first = signal.getsignal(signal.SIGINT), self.on_sigint
        assert callable(ray_handler)  # the Python function Ray Train has just installed

        def handler(signum: int, frame: FrameType | None) -> None:
            if not first():
                ray_handler(signum, frame)

        signal.signal(signal.SIGINT, handler)


class RequesterLog(ControllerCallback):
    """Notes the id under which this run's controller asks Ray Data's autoscaling coordinator for the
    workers' resources (Ray Train's scaling policy names it `train-<run id>`) with `note(requester)`: a
    controller killed with its job cancels nothing, and the next driver cancels it
    (trainapp/launch/ray/stop.py's `release_left_behind`)."""

    def __init__(self, note: Callable[[str], None]) -> None:
        self.note = note

    def after_controller_start(self, train_run_context: TrainRunContext) -> None:
        try:
            self.note(f"train-{train_run_context.run_id}")
        except OSError as e:  # information only: a full disk must not fail the controller
            say(f"could not note the run's resource request: {e}")


def cancel_resource_requests(ids: list[str]) -> list[str]:
    """Cancel the coordinator's requests `ids` (those it still holds); the ids it was asked to cancel.
    Nothing, with one warning line, when the coordinator cannot be reached: the requests then expire."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    try:
        coordinator = get_or_create_autoscaling_coordinator()
        ray.get([coordinator.cancel_request.remote(requester_id=i) for i in ids], timeout=10)
    except Exception as e:
        logging.getLogger("trainapp.ray").warning(
            "could not cancel the resource requests earlier attempts left (%s: %s): an elastic run may wait "
            "up to 180 s for them to expire", e.__class__.__name__, e)
        return []
    return ids
