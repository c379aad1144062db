"""`python -m trainapp ray`: the driver `ray job submit` runs. Ray Train's TorchTrainer starts one
worker per rank, each running the same rank as torchrun would (`run_rank`, through
trainapp/launch/ray/worker.py).

The driver checks the cluster first (capacity, storage, each node's network interface;
trainapp/launch/ray/checks.py), so a run that cannot work stops with one line, and it turns a
worker's bad input or storage failure back into that one line. Ray's private API is used only
through trainapp/launch/ray/private/.

Start-up order: the driver joins the cluster and starts the per-node probes before it imports Ray
Train (seconds of CPU), so the two overlap; it never imports torch, which only the workers need. Its
`Timeline` marks each phase for the launch breakdown of bench/launchers.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from trainapp.config import Config, ConfigError
from trainapp.errors import Failure
from trainapp.launch.ray.checks import (
    Preflight,
    check_capacity,
    check_global_batch,
    check_version,
    is_uri,
    ray_address,
    worker_needs,
)
from trainapp.launch.ray import spares
from trainapp.launch.ray.output import StartGate
from trainapp.launch.ray.stop import DriverStop, note_request, release_left_behind
from trainapp.observe import tracking
from trainapp.observe.timeline import Timeline

if TYPE_CHECKING:
    from ray.train import UserCallback
    from ray.train.v2.api.callback import RayTrainCallback
    from ray.train.v2.api.result import Result  # `ray.train.Result` is Ray Train V1's to mypy

    from trainapp.config import TrainSection
    from trainapp.launch.ray.private.backend import TorchConfigWithSetup
    from trainapp.launch.ray.private.callbacks import TrainRunContext
    from trainapp.launch.ray.private.trainer import TorchTrainer
    from trainapp.snapshots.lease import Lease

log = logging.getLogger("trainapp.ray")


def _torch_config(cfg: Config, threads: int, worker: Callable[[dict[str, Any]], Any]) -> TorchConfigWithSetup:
    from trainapp.launch.ray.private.backend import TorchConfigWithSetup
    from trainapp.launch.ray.setup import IMPORTS, prepare_worker

    return TorchConfigWithSetup(timeout_s=int(cfg.dist.timeout_s), setup=prepare_worker,
                                setup_kwargs={"env": dict(cfg.ray.env), "threads": threads,
                                              "network": dataclasses.asdict(cfg.network),
                                              "preemption": dataclasses.asdict(cfg.preempt),
                                              "imports": IMPORTS[worker]})


def connect(address: str, hook: str | None = None) -> str:
    """ray.init for the cluster we run in, the one named, or an embedded one, with `hook` as the job's
    `worker_process_setup_hook`. Returns a description."""
    import ray

    env = {"worker_process_setup_hook": hook} if hook else None
    try:
        if address:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True, runtime_env=env)
            return f"cluster at {address}"
        ray.init(logging_level=logging.WARNING, runtime_env=env)
        return "embedded local Ray"
    except ConnectionError as e:
        raise ConfigError(f"ray.address={address}: cannot join the Ray cluster "
                          f"({str(e).splitlines()[0]})") from None


def _job_hook() -> str | None:
    """The `worker_process_setup_hook` of the runtime env this job was submitted with (`ray job submit
    --runtime-env-json`), which Ray hands the driver in RAY_JOB_CONFIG_JSON_ENV_VAR."""
    try:
        given = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}"))
        return (given.get("runtime_env") or {}).get("worker_process_setup_hook")
    except (ValueError, AttributeError):
        return None


def _error_in(exc: BaseException) -> Failure | None:
    """The ending trainapp explains (a `Failure`: bad input, storage, ...) raised in a worker or in the
    backend's setup, if that is what ended the run (through Ray's public failure types:
    WorkerGroupError.worker_failures, ControllerError.controller_failure, RayTaskError.cause), as a
    plain one with the same message, cause and exit code."""
    from ray.exceptions import RayTaskError
    from ray.train import ControllerError, WorkerGroupError

    roots = list(exc.worker_failures.values()) if isinstance(exc, WorkerGroupError) else []
    for err in roots + [exc]:
        seen: BaseException | None = err
        while seen is not None:
            # A RayTaskError poses as its cause's class but prints Ray's header: rebuild the plain one.
            found = seen.cause if isinstance(seen, RayTaskError) and isinstance(seen.cause, Failure) else seen
            if isinstance(found, Failure):
                plain = Failure(str(found))
                (plain.cause, plain.exit_code,
                 plain.everywhere) = found.cause, found.exit_code, found.everywhere
                return plain
            if isinstance(seen, ControllerError):
                seen = seen.controller_failure
            elif isinstance(seen, RayTaskError):
                seen = seen.cause
            else:
                seen = seen.__cause__
    return None


def _group_failure_log(run_dir: str) -> UserCallback:
    """A Ray Train callback (public `UserCallback`, run by the controller) that appends one
    `group_failure` record to the run's metrics.jsonl when the controller finds workers of the group
    failed: each failed rank with its error, and the time. A rank killed outright (SIGKILL, a lost
    node, the OOM killer) writes nothing itself, so this is the only word on it, and the moment Ray
    noticed (the restart breakdown of bench/launchers.py starts there)."""
    from ray.train import UserCallback

    from trainapp.observe import metrics

    class GroupFailureLog(UserCallback):
        def after_exception(self, run_context: TrainRunContext,
                            worker_exceptions: dict[int, Exception]) -> None:
            errors = {str(rank): f"{e.__class__.__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
                      for rank, e in sorted(worker_exceptions.items())}
            try:
                metrics.append(run_dir, "group_failure", errors=errors)
            except OSError as e:  # the record is information: a full disk must not fail the controller
                log.warning("could not record the worker group's failure in %s: %s", run_dir, e)

    return GroupFailureLog()


def _controller_dir(cfg: Config, storage: str) -> str:
    """The run's folder as the driver's callbacks write to it: the resize controller asks there, and an
    elastic group's workers read its requests there (the payload's `resizes`)."""
    return f"{storage}/{cfg.ray.name}"


def _callbacks(cfg: Config, storage: str, generation: int) -> list[RayTrainCallback]:
    from trainapp.launch.ray.private.resource_requests import RequesterLog

    run_dir = _controller_dir(cfg, storage)
    callbacks: list[RayTrainCallback] = [] if is_uri(storage) else [_group_failure_log(run_dir)]
    if generation and not is_uri(storage):
        callbacks.append(RequesterLog(functools.partial(note_request, storage, run_dir=run_dir,
                                                        generation=generation)))
    if not cfg.ray.elastic:
        return callbacks
    from trainapp.launch.ray.private.node_loss import NodeLossWatch
    from trainapp.launch.ray.resize import ResizeSnapshot

    # The workers' agreed stop and snapshot take at most preempt.grace_s; the margin is the polls'.
    return [*callbacks, NodeLossWatch(cfg.ray.node_loss_wait_s),
            ResizeSnapshot(run_dir, cfg.preempt.grace_s + 5, cfg.ray.resize_check_s / 2)]


def _elastic_batch(cfg: Config) -> TrainSection:
    """The train section the workers get: an elastic run that keeps its global batch across resizes
    (`train.on_resize=keep`) and names none has the global batch of its largest group, whatever size
    it starts at, so every size it may run at splits it (trainapp/core/layout.py)."""
    t = cfg.train
    if not cfg.ray.elastic or t.global_batch or t.on_resize != "keep":
        return t
    return dataclasses.replace(t, global_batch=t.batch_size * t.grad_accum * cfg.ray.max_workers)


def _trainer(cfg: Config, storage: str, needs: dict[str, float], use_gpu: bool, timeline: Timeline,
             worker: Callable[[dict[str, Any]], Any] | None = None, lease: Lease | None = None,
             **extra: Any) -> TorchTrainer:
    """Ray Train's TorchTrainer over `worker` (`train_worker`), with the run directory at STORAGE/NAME;
    the driver's `timeline`, its `lease` (the workers' fence) and `extra` go into each worker's payload."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from trainapp.launch.ray.private import controller, trainer, versions
    from trainapp.launch.ray.setup import PRELOADS, train_worker

    for line in versions.lost(drains=bool(cfg.preempt.ray_poll_s),
                              elastic=cfg.ray.elastic):
        log.warning("%s", line)  # what this Ray cannot do for the run, once, before it starts

    worker = worker or train_worker
    run_dir = f"{storage}/{cfg.ray.name}" if not is_uri(storage) else cfg.run.dir
    worker_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=run_dir),
                                     train=_elastic_batch(cfg))
    threads = cfg.ray.threads_per_worker or max(1, int(needs.get("CPU", 1)))
    os.environ.update(controller.controller_env(cfg.ray.worker_group_start_timeout_s,
                                                cfg.ray.health_check_interval_s))
    held = {"lease": {"fence": lease.fence.to_dict(), "summary": lease.summary()}} if lease else {}
    elastic = {"elastic_resize_monitor_interval_s": cfg.ray.resize_check_s} if cfg.ray.elastic else {}
    resizes = {"resizes": _controller_dir(cfg, storage)} if cfg.ray.elastic else {}
    # A spare process (trainapp/launch/ray/spares.py) gets the training workers' runtime env, this included.
    preload = ({"worker_runtime_env": {"env_vars": {spares.PRELOAD: ",".join(PRELOADS[worker])}}}
               if cfg.ray.spare_workers and worker in PRELOADS and not _job_hook() else {})
    return trainer.TorchTrainer(
        worker,
        train_loop_config={"config": worker_cfg.to_dict(), "launch": timeline.marks(), **extra, **held,
                           **resizes},
        torch_config=_torch_config(cfg, threads, worker),
        # mypy takes ray.train's ScalingConfig and RunConfig for Ray Train V1's (ray.air): no (min, max)
        # num_workers, no V2 callbacks; and it matches the optional keyword's dict against every keyword.
        scaling_config=ScalingConfig(num_workers=cfg.ray.num_workers,  # type: ignore[arg-type]
                                     use_gpu=use_gpu, resources_per_worker=needs,
                                     **elastic),  # type: ignore[arg-type]
        run_config=RunConfig(
            name=cfg.ray.name, storage_path=storage,
            failure_config=FailureConfig(max_failures=cfg.ray.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.snapshot.keep),
            callbacks=_callbacks(cfg, storage, lease.generation if lease else 0),  # type: ignore[arg-type]
            **preload,  # type: ignore[arg-type]
        ),
    )


def preflight_task(cfg: Config) -> None:
    """The user's task `task.name` names, made once here so that a module that does not import, a
    missing attribute or method, or `task.args` its factory rejects stop the run in one line before any
    worker starts. A built-in task is not made here: that would import torch into the driver for
    nothing (its `task.args` are checked in the workers, with the same line); a task object handed over
    from Python was checked when it was (trainapp/tasks/load.py's `configure`)."""
    from trainapp.config import BUILTIN_TASKS

    if cfg.task.name not in BUILTIN_TASKS:
        from trainapp.tasks.load import resolve

        resolve(cfg)


def run(cfg: Config, task: Any = None) -> dict[str, Any]:
    """Fit a TorchTrainer over the cluster on `task` (default: the one `task.name` names, imported by
    each worker, where Ray's runtime environment ships the user's code); returns the rank-0 summary
    (with `stopped_by` and `exit_code` when the driver was told to stop: trainapp/launch/ray/stop.py)."""
    check_global_batch(cfg.train, cfg.ray.max_workers)
    tracking.check(cfg.observe)  # a tracker set without its package: one line here, before any worker starts
    if task is None:
        preflight_task(cfg)
    result, storage, stopped = _fit(cfg, **({"task": task} if task is not None else {}))
    return {**(result.metrics or {}), "storage": f"{storage}/{cfg.ray.name}", **stopped}


def run_comm(cfg: Config, size_mb: float, iters: int, min_bandwidth: float) -> int:
    """`doctor --comm` as a Ray job: the workers Ray Train starts for `cfg` measure every node pair
    (trainapp/launch/comm.py), the driver prints the result; the exit code is comm's verdict."""
    from trainapp.launch import comm
    from trainapp.launch.ray.setup import comm_worker

    comm.check_args(size_mb, iters, min_bandwidth)
    # A run of its own (NAME-comm), not retried: a failure is the answer.
    cfg = dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, name=f"{cfg.ray.name}-comm",
                                                           max_failures=0))
    result, _, _ = _fit(cfg, worker=comm_worker, nbytes=int(size_mb * 2**20), iters=iters)
    m = result.return_value  # rank 0's
    assert m is not None  # comm_worker returns its dict on every rank
    pairs = [comm.Pair(**p) for p in m["comm_pairs"]]
    return comm.show(m["comm_backend"], m["comm_processes"], m["comm_via"], m["comm_nodes"], pairs,
                     min_bandwidth)


def _fit(cfg: Config, worker: Callable[[dict[str, Any]], Any] | None = None,
         **extra: Any) -> tuple[Result, str, dict[str, Any]]:
    """Join, check, fit; (Ray Train's Result, the storage path, the stop's summary). Ray's output is held
    back until the run trains (trainapp/launch/ray/output.py): a failed start on bad input is one line."""
    timeline = Timeline()
    timeline.mark_process("driver_process")
    address = ray_address(cfg.ray)
    check_version()  # a Ray it was not written for stops here, before anything imports it
    gate = StartGate().install()  # before Ray is imported: its loggers keep the streams they find
    try:
        return _fit_connected(cfg, timeline, gate, address, worker, **extra)
    except Failure as e:
        if e.exit_code != 2:
            raise
        dropped = gate.discard()
        if not dropped:
            raise
        raise _with_hint(e, dropped, gate.logs_dir) from None
    finally:
        gate.uninstall()


def _with_hint(e: Failure, dropped: int, logs_dir: str | None) -> Failure:
    """The one line of a failed start, saying where Ray's own lines about it went."""
    where = f"the session logs ({logs_dir} on this node, the same path on the others)" if logs_dir else \
        "the session logs of each node (/tmp/ray/session_latest/logs)"
    plain = Failure(f"{e} (Ray's {dropped} lines about it are in {where})")
    plain.cause, plain.exit_code, plain.everywhere = e.cause, e.exit_code, e.everywhere
    return plain


def _fit_connected(cfg: Config, timeline: Timeline, gate: StartGate, address: str,
                   worker: Callable[[dict[str, Any]], Any] | None = None,
                   **extra: Any) -> tuple[Result, str, dict[str, Any]]:
    """`_fit` once the streams are gated: join, check, fit, and leave the cluster (after the gate's
    verdict, so that what Ray prints while it shuts down goes the same way)."""
    spare = cfg.ray.spare_workers and worker is None
    theirs = _job_hook() if spare else None
    if theirs:
        log.warning("ray.spare_workers: off for this job: its runtime_env has a worker_process_setup_hook "
                    "of its own (%s), and a job has only one", theirs)
    where = connect(address, spares.HOOK if spare and not theirs else None)
    timeline.mark("driver_connected")
    import ray

    from trainapp.launch.ray.private import versions

    gate.logs_dir = versions.logs_dir()  # while connected
    try:
        storage, needs, use_gpu = _preflight(cfg, timeline, where)
        return _fit_checked(cfg, timeline, storage, needs, use_gpu, worker, **extra)
    except Failure as e:
        if e.exit_code == 2:
            # Before Ray shuts down: what it still prints of the failed start stays in its logs.
            gate.discard()
        raise
    finally:
        gate.release()
        if spare:
            spares.forget(ray.get_runtime_context().get_job_id())
        ray.shutdown()


def gpus_for_workers(cfg: Config, cluster_gpus: float) -> bool:
    """Whether Ray Train gives each worker a GPU (and NCCL): `ray.use_gpu`, else `dist.device`, else
    whether the cluster has GPUs. ConfigError where the two keys contradict each other."""
    use_gpu, device = cfg.ray.use_gpu, cfg.dist.device
    if use_gpu is not None and device != "auto" and use_gpu != (device == "cuda"):
        raise ConfigError(f"dist.device={device} with ray.use_gpu={str(use_gpu).lower()}: workers train "
                          "where Ray puts them; set ray.use_gpu=" + ("true" if device == "cuda" else "false")
                          + " or dist.device=auto")
    if use_gpu is not None:
        return use_gpu
    return device == "cuda" or (device == "auto" and cluster_gpus > 0)


def _preflight(cfg: Config, timeline: Timeline, where: str) -> tuple[str, dict[str, float], bool]:
    """The cluster's capacity, the storage, each node's network and Ray's record of the run checked;
    (the storage path, one worker's resources, whether workers get GPUs)."""
    import ray

    resources = ray.cluster_resources()
    use_gpu = gpus_for_workers(cfg, resources.get("GPU", 0))
    needs = worker_needs(cfg.ray, use_gpu)
    check_capacity(cfg.ray, needs)
    storage = (cfg.ray.storage_path if is_uri(cfg.ray.storage_path)
               else str(Path(cfg.ray.storage_path).resolve()))
    checks = Preflight(cfg.network, cfg.ray.env, storage, cfg.ray.checks_timeout_s)
    # Ray Train takes seconds to import (the trainer's module, used later, the most of it): while the
    # probes start on the nodes. Nothing the driver imports brings in torch (trainapp/launch/ray/private/,
    # trainapp/launch/ray/setup.py).
    from trainapp.launch.ray.private import run_record, trainer  # noqa: F401
    timeline.mark("driver_imported")
    run_record.check_run_record(storage, cfg.ray.name)
    for line in checks.wait():
        log.info("network %s", line)
    log.info("the checks on %d node(s) took %.1f s", len(checks.nodes), time.monotonic() - checks.started)
    log.info("%s: %s workers, %s per worker, storage %s/%s", where, cfg.ray.num_workers, needs, storage,
             cfg.ray.name)
    timeline.mark("driver_checked")
    return storage, needs, use_gpu


def _fit_checked(cfg: Config, timeline: Timeline, storage: str, needs: dict[str, float], use_gpu: bool,
                 worker: Callable[[dict[str, Any]], Any] | None = None,
                 **extra: Any) -> tuple[Result, str, dict[str, Any]]:
    """Ray Train's fit, under the run's lease; (its Result, the storage path, the stop's summary)."""
    lease = _take_lease(cfg, storage) if worker is None else None
    stop = None
    try:
        trainer = _trainer(cfg, storage, needs, use_gpu, timeline, worker, lease, **extra)
        if lease is not None:
            _release_left_behind(storage)
            stop = DriverStop(lease)
            trainer.on_sigint = stop.on_sigint
        # Ray annotates `fit` with `ray.train.Result`, which mypy takes for V1's; it is V2's.
        result: Result = trainer.fit()  # type: ignore[assignment]
    except Exception as e:
        plain = _error_in(e)
        if plain is not None:
            raise plain from None
        raise
    finally:
        if stop is not None:
            stop.close()
        if lease is not None:
            lease.release()
    return result, storage, stop.summary(result.metrics or {}) if stop is not None and stop.signum else {}


def _release_left_behind(storage: str) -> None:
    if is_uri(storage):
        return
    released = release_left_behind(storage)
    if released:
        log.info("released the resource request(s) %s that runs killed before they ended left with Ray's "
                 "autoscaling coordinator", ", ".join(released))


def _take_lease(cfg: Config, storage: str) -> Lease | None:
    """The run STORAGE/NAME's lease, held by this driver for the whole fit: Ray Train's retries of the
    worker group are this run; another submission of the same name is another (trainapp/snapshots/lease.py).
    None with `run.lease_s=0`."""
    if cfg.run.lease_s <= 0:
        return None
    from trainapp.snapshots.lease import Lease

    return Lease.take(f"{storage}/{cfg.ray.name}", "ray", cfg.run.lease_s, cfg.run.take_over).start()
