"""`python -m trainapp ray`: the driver `ray job submit` runs. Ray Train's TorchTrainer starts one
worker per rank, each running the same loop (`trainapp.loop`) as torchrun would.

Differences from torchrun live here only: snapshots are published with `ray.train.report` (RayPublish,
the snapshot manager's publish step), resume comes from the shared run directory (or from
`ray.train.get_checkpoint()` with a URI `ray.storage_path`), the worker environment is set before Ray
creates the process group, and the driver checks the cluster first (capacity, storage, each node's
network interface) so a run that cannot work stops with one line. Ray's private API is used only
through trainapp/ray_compat.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import sys
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from trainapp import config, dist, logs
from trainapp.config import Config, ConfigError
from trainapp.snapshot import SnapshotManager, find_shared, load_state, step_name, verify

log = logging.getLogger("trainapp.ray")


def _is_uri(path: str) -> bool:
    return "://" in path


# ----------------------------------------------------------------------------------------------
# Worker side


class RayPublish:
    """The publish step of snapshots under Ray Train: every rank calls `ray.train.report` at the same
    steps (it is a barrier across workers), rank 0 with the snapshot as a checkpoint. The directory
    format is the local one, so one format serves every launcher.

    Ray only ever registers a snapshot trainapp has put in place (`NO_UPLOAD`), never uploads one:
    on a filesystem path rank 0 writes it there atomically, as under torchrun (an upload from a local
    directory would write every snapshot twice); to a URI rank 0 writes it locally and uploads it with
    pyarrow, as Ray would. So a failed write or upload is a failed snapshot like a full local disk
    (counted against `snapshot.max_failures`, nothing partial left), not an error inside
    `ray.train.report` that ends the run and leaves the worker's report sequence broken.

    With `snapshot.async` the write (and upload) runs in the snapshot writer's thread, and the snapshot
    is registered with the next report, one interval later (or by `flush` at the end of the run or a
    stop): Ray must not register what is not on storage yet.
    """

    def __init__(self, uri: str | None, async_write: bool, name: str):
        self.uri = uri
        self.background = async_write
        self.fs = None
        if uri is not None:
            from pyarrow.fs import FileSystem

            self.fs, base = FileSystem.from_uri(uri)
            self.experiment = f"{base.rstrip('/')}/{name}"  # the path on `fs`
            self.shown = f"{uri.rstrip('/')}/{name}"  # the same as a URI, for messages
        self.pending: tuple[int, Path | str] | None = None
        """Rank 0, background writes: the snapshot written since the last report, not yet registered."""
        self.last_metrics: dict[str, Any] = {}

    def root(self, run_dir: Path) -> Path:
        return run_dir  # Ray stores the checkpoints as STORAGE/NAME/step_*: the run directory itself

    def place(self, manager: SnapshotManager, step: int) -> Path:
        if self.uri is None:
            return manager.path_for(step)
        return Path(tempfile.gettempdir()) / f"trainapp-snap-{uuid.uuid4().hex[:12]}"  # uploaded in `written`

    def written(self, manager: SnapshotManager, step: int, path: Path) -> Path | str:
        manager.sweep_leftovers()  # Ray keeps `snapshot.keep` checkpoints (CheckpointConfig) and deletes the rest
        where = self._upload(step, path) if self.uri is not None else path
        if self.background:
            self.pending = (step, where)  # read by the training thread after it joined this writer
        return where

    def _upload(self, step: int, path: Path) -> str:
        from pyarrow.fs import copy_files

        dest = f"{self.experiment}/{step_name(step)}"
        try:
            self.fs.create_dir(dest)
            copy_files(str(path), dest, destination_filesystem=self.fs)
        except OSError as e:
            with contextlib.suppress(OSError):
                self.fs.delete_dir(dest)
            # pyarrow names no file, and a remote store's errors carry no errno: EIO stands for those.
            code = e.errno or errno.EIO
            why = os.strerror(e.errno) if e.errno else f"upload failed: {str(e).split('. Detail:')[0]}"
            raise OSError(code, why, f"{self.shown}/{step_name(step)}") from None
        finally:
            shutil.rmtree(path, ignore_errors=True)
        return dest

    def make_room(self, manager: SnapshotManager) -> int:
        return 0  # Ray owns its checkpoints' retention: deleting them under it would confuse its bookkeeping

    def destination(self, manager: SnapshotManager) -> tuple[str, str]:
        return (self.shown if self.uri is not None else str(manager.root)), "ray.storage_path"

    def publish(self, ctx, step: int, path: Path | str | None, metrics: dict[str, Any]) -> None:
        self.last_metrics = metrics
        self._report(ctx, step, path, metrics)

    def flush(self, ctx) -> None:
        if self.background:  # every rank: one more report, registering the last background write
            self._report(ctx, None, None, self.last_metrics)

    def _report(self, ctx, step: int | None, path: Path | str | None, metrics: dict[str, Any]) -> None:
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        if path is None and self.pending is not None and ctx.is_main:
            (step, path), self.pending = self.pending, None
        ckpt = None
        if path is not None:
            ckpt = Checkpoint(str(path), filesystem=self.fs) if self.fs is not None else Checkpoint.from_directory(path)
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
                         checkpoint_dir_name=step_name(step) if step is not None else None)

    def find(self, ctx, manager: SnapshotManager) -> tuple[str, dict[str, Any]] | None:
        if self.uri is None:
            # On a shared filesystem the directory is the truth: Ray registers a reported checkpoint
            # only when its controller next polls, so a worker lost right after a report can leave
            # Ray's newest checkpoint one snapshot behind what is safely on disk.
            return find_shared(ctx, manager.root)
        import ray.train

        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            return None
        with ckpt.as_directory() as d:
            verify(Path(d))
            return ckpt.path, load_state(Path(d))


def prepare_worker(env: dict[str, str], threads: int, network: dict[str, Any], preemption: dict[str, Any]) -> str:
    """Runs in every worker before Ray creates the process group, in the worker's main thread (where
    Python takes signals: the loop runs in a thread of Ray's); returns its network choice."""
    import torch

    from trainapp import net, preempt

    # Ray's own SIGTERM handler ends the worker at once; ours turns it into the agreed stop.
    preempt.install(preemption["signals"], preemption["grace_s"])
    preempt.register()  # `trainapp drain` finds this worker; the entry goes stale with the process
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return net.apply(config.NetworkSection(**network), net.ray_head_host()).summary()


class RayDrainNotice:
    """`ray.train.get_preemption_info()` as the loop's drain notice (every `preempt.ray_poll_steps`
    steps; a barrier, so every rank asks at the same steps): a description while a node of the run is
    being drained, None otherwise (`new` is true the first time a drain is seen). The loop snapshots
    at every such answer, so the drained node can die at any moment of its notice window and cost at
    most `preempt.ray_poll_steps` steps; Ray Train then restarts the group from that snapshot."""

    def __init__(self) -> None:
        self.seen: tuple | None = None

    def __call__(self) -> dict[str, Any] | None:
        import ray.train

        info = ray.train.get_preemption_info()
        if info is None:
            return None
        key = (tuple(info.preempted_node_ids), info.deadline_ms)
        new, self.seen = key != self.seen, key
        left = round(info.deadline_ms / 1000 - time.time(), 1) if info.deadline_ms else None
        return {"new": new, "nodes": info.preempted_node_ids, "ranks": info.preempted_ranks, "deadline_in_s": left,
                "what": f"Ray node(s) {', '.join(n[:12] for n in info.preempted_node_ids)} drained for preemption "
                        f"(ranks {info.preempted_ranks}, deadline in {left} s)"}


def train_worker(payload: dict[str, Any]) -> None:
    """The per-worker function: the same loop as torchrun's, with snapshots published to Ray."""
    from trainapp import loop, preempt

    cfg = config.from_dict(payload["config"])
    ctx = dist.setup(cfg.dist.timeout_s)  # adopts the group Ray created
    logs.setup(ctx.rank, ctx.world_size)
    uri = cfg.ray.storage_path if _is_uri(cfg.ray.storage_path) else None
    snapshots = SnapshotManager.from_config(cfg, RayPublish(uri, async_write=cfg.snapshot.async_, name=cfg.ray.name))
    notice = RayDrainNotice() if cfg.preempt.ray_poll_steps else None
    try:
        loop.train(cfg, ctx, snapshots, notice)
    except preempt.Preempted as e:
        # The snapshot is reported; the process ends as under torchrun, and Ray Train restarts the group
        # from it (on the nodes that are left when a node is going away).
        if e.rank == 0:
            print(e.line(), file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(e.exit_code)
    finally:
        preempt.training_over()
        dist.teardown(ctx)


def _torch_config(cfg: Config, threads: int):
    from trainapp.ray_compat import TorchConfigWithSetup

    return TorchConfigWithSetup(timeout_s=int(cfg.dist.timeout_s), setup=prepare_worker,
                                setup_kwargs={"env": dict(cfg.ray.env), "threads": threads,
                                              "network": dataclasses.asdict(cfg.network),
                                              "preemption": dataclasses.asdict(cfg.preempt)})


# ----------------------------------------------------------------------------------------------
# Driver side: checks that turn a would-be hang into a one-line error


def _check_reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address={address!r}: expected host:port of the Ray head (GCS), e.g. 127.0.0.1:6379")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except OSError as e:
        raise ConfigError(f"ray.address={address}: no Ray cluster answers there ({e.strerror or e}); start one "
                          "(make ray-up) or leave ray.address empty for an embedded local Ray") from None


def ray_address(cfg: Config) -> str:
    """The cluster to join ('' for an embedded one), checked to answer; also the environment an
    embedded Ray needs, which Ray reads when it is imported: so this runs before anything imports ray."""
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    if address and address != "auto" and "://" not in address:
        _check_reachable(address)
    if not address:
        # An embedded instance is for this machine only: bind loopback, not the external address
        # (inherited by the processes it starts).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    return address


def connect(address: str) -> str:
    """ray.init for the cluster we run in, the one named, or an embedded one. Returns a description."""
    import ray

    try:
        if address:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
            return f"cluster at {address}"
        ray.init(logging_level=logging.WARNING)
        return "embedded local Ray"
    except ConnectionError as e:
        raise ConfigError(f"ray.address={address}: cannot join the Ray cluster ({str(e).splitlines()[0]})") from None


def _worker_needs(cfg: Config, use_gpu: bool) -> dict[str, float]:
    needs = dict(cfg.ray.resources_per_worker) or {"CPU": 1.0}
    if use_gpu:
        needs.setdefault("GPU", 1.0)
    return needs


def check_capacity(cfg: Config, needs: dict[str, float]) -> int:
    """How many workers the alive nodes can hold; ConfigError when fewer than the minimum."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    capacity = 0
    for n in nodes:
        res = n.get("Resources", {})
        capacity += min(int(res.get(k, 0) // v) if v > 0 else 10**6 for k, v in needs.items())
    if cfg.ray.check_resources and capacity < cfg.ray.min_workers:
        have = ", ".join(f"{n.get('NodeManagerAddress')}: {int(n.get('Resources', {}).get('CPU', 0))} CPU "
                         f"{int(n.get('Resources', {}).get('GPU', 0))} GPU" for n in nodes)
        raise ConfigError(f"ray.num_workers={cfg.ray.min_workers}: the cluster can hold at most {capacity} workers "
                          f"needing {needs} ({have}); add nodes, lower ray.num_workers, or set "
                          "ray.check_resources=false on an autoscaling cluster")
    return capacity


def _on_every_node(fn, nodes: list[dict], what: str, *args) -> list:
    """Run `fn(*args)` once on each of `nodes` (no CPU reserved) and return the results in order;
    a ConfigError naming `what` if they do not all finish within 60 s."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(*args)
            for n in nodes]
    try:
        return ray.get(refs, timeout=60)
    except ray.exceptions.GetTimeoutError:
        raise ConfigError(f"{what}: the check did not finish on every node within 60 s") from None


def _probe_writable(path: str) -> str:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        marker = Path(path) / f".write-probe-{socket.gethostname()}-{os.getpid()}"
        marker.write_text("ok")
        marker.unlink()
        return ""
    except OSError as e:
        return f"{e.__class__.__name__}: {e.strerror or e}"


def _probe_network(network: dict, env: dict) -> tuple[str, str]:
    from trainapp import net

    try:
        res = net.apply(config.NetworkSection(**network), net.ray_head_host(), environ={**os.environ, **env})
        return "", res.summary()
    except net.NetworkError as e:
        return str(e), ""


def check_storage(storage: str) -> None:
    """Every alive node must be able to write the storage path (a worker writes metrics and markers)."""
    if _is_uri(storage):
        return
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for n, err in zip(nodes, _on_every_node(_probe_writable, nodes, f"ray.storage_path={storage}", storage)):
        if err:
            raise ConfigError(f"ray.storage_path={storage}: not writable on node {n['NodeManagerAddress']} "
                              f"{n['NodeID'][:8]} ({err}); use a path every node can write (shared storage) or a URI")


def check_network(cfg: Config) -> list[str]:
    """Resolve `network.interface` on every node that can hold a worker, as its workers will; one
    line per node. A node that cannot honour it stops the run here, naming the node and what it has,
    instead of after a worker-group start and a process group that never forms."""
    import ray

    # A head with no CPUs or GPUs trains nothing.
    nodes = [n for n in ray.nodes()
             if n.get("Alive") and (n["Resources"].get("CPU", 0) > 0 or n["Resources"].get("GPU", 0) > 0)]
    results = _on_every_node(_probe_network, nodes, "network.interface", dataclasses.asdict(cfg.network),
                             dict(cfg.ray.env))
    for n, (err, _) in zip(nodes, results):
        if err:
            raise ConfigError(f"node {n['NodeManagerAddress']}: {err}")
    return [f"node {n['NodeManagerAddress']}: {summary}" for n, (_, summary) in zip(nodes, results)]


def _error_in(exc: BaseException) -> Exception | None:
    """A ConfigError or StorageError raised in a worker or in the backend's setup, if that is what
    ended the run (through Ray's public failure types: WorkerGroupError.worker_failures,
    ControllerError.controller_failure, RayTaskError.cause), as a plain one of its class."""
    from ray.exceptions import RayTaskError
    from ray.train import ControllerError, WorkerGroupError

    from trainapp.snapshot import StorageError

    roots = list(exc.worker_failures.values()) if isinstance(exc, WorkerGroupError) else []
    for err in roots + [exc]:
        seen = err
        while seen is not None:
            for kind in (ConfigError, StorageError):
                # A RayTaskError poses as its cause's class but prints Ray's header: rebuild the plain one.
                if isinstance(seen, RayTaskError) and isinstance(seen.cause, kind):
                    return kind(str(seen.cause))
                if isinstance(seen, kind):
                    return kind(str(seen))
            if isinstance(seen, ControllerError):
                seen = seen.controller_failure
            elif isinstance(seen, RayTaskError):
                seen = seen.cause
            else:
                seen = seen.__cause__
    return None


def _callbacks(cfg: Config) -> list:
    if cfg.ray.min_workers == cfg.ray.max_workers:
        return []
    from trainapp.ray_compat import NodeLossWatch

    return [NodeLossWatch(cfg.ray.node_loss_wait_s)]


def _trainer(cfg: Config, storage: str, needs: dict[str, float], use_gpu: bool):
    """Ray Train's TorchTrainer over `train_worker`, with the run directory at STORAGE/NAME."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from trainapp import ray_compat

    run_dir = f"{storage}/{cfg.ray.name}" if not _is_uri(storage) else cfg.run.dir
    worker_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=run_dir))
    threads = cfg.ray.threads_per_worker or max(1, int(needs.get("CPU", 1)))
    os.environ.update(ray_compat.controller_env(cfg.ray.worker_group_start_timeout_s,
                                                cfg.ray.health_check_interval_s))
    return TorchTrainer(
        train_worker,
        train_loop_config={"config": worker_cfg.to_dict()},
        torch_config=_torch_config(cfg, threads),
        scaling_config=ScalingConfig(num_workers=cfg.ray.num_workers, use_gpu=use_gpu, resources_per_worker=needs),
        run_config=RunConfig(
            name=cfg.ray.name, storage_path=storage,
            failure_config=FailureConfig(max_failures=cfg.ray.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.snapshot.keep),
            callbacks=_callbacks(cfg),
        ),
    )


def run(cfg: Config) -> dict[str, Any]:
    """Fit a TorchTrainer over the cluster; returns the rank-0 summary of the finished run."""
    address = ray_address(cfg)
    from trainapp import ray_compat  # the first import of ray: a Ray it was not written for stops here

    ray_compat.check_version()
    where = connect(address)
    import ray

    try:
        resources = ray.cluster_resources()
        use_gpu = cfg.ray.use_gpu if cfg.ray.use_gpu is not None else resources.get("GPU", 0) > 0
        needs = _worker_needs(cfg, use_gpu)
        check_capacity(cfg, needs)
        storage = cfg.ray.storage_path if _is_uri(cfg.ray.storage_path) else str(Path(cfg.ray.storage_path).resolve())
        check_storage(storage)
        for line in check_network(cfg):
            log.info("network %s", line)
        log.info("%s: %s workers, %s per worker, storage %s/%s", where, cfg.ray.num_workers, needs, storage,
                 cfg.ray.name)
        try:
            result = _trainer(cfg, storage, needs, use_gpu).fit()
        except Exception as e:
            plain = _error_in(e)
            if plain is not None:
                raise plain from None
            raise
        return {**(result.metrics or {}), "storage": f"{storage}/{cfg.ray.name}"}
    finally:
        ray.shutdown()
