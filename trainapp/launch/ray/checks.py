"""The Ray driver's checks of a cluster before a run: they turn a would-be hang into a one-line error.

Ray's version, the head's address, whether the alive nodes can hold the workers, and on every node
in one task each: that it can write the storage path and that it resolves `network.interface` as its
workers will. This module imports neither torch nor Ray Train (nor does anything the probe tasks
unpickle), so a probe task is a bare Ray worker on its node, and the driver starts the probes before
it imports Ray Train and torch itself: the two overlap (see `Preflight`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainapp import config
from trainapp.config import ConfigError, NetworkSection, RaySection, TrainSection

if TYPE_CHECKING:
    from pyarrow.fs import FileSystem

SUPPORTED = ("2.55.0", "2.61.0")
"""The Ray versions trainapp supports, at least the first, below the second: the six latest minor releases
(Ray requires the driver, the job and the cluster on one version, and users do not pick their
cluster's). The driver refuses others; docs/ray.md's "Ray versions" table, the images' build and the
KubeRay manifests are checked against it (tests/test_ray_compat.py, tests/test_k8s.py); what differs
inside it is trainapp/launch/ray/private/versions.py's."""

NEWEST_TESTED = "2.60.0"
"""The Ray the development environment, the images (docker/Dockerfile's RAY_VERSION default) and the KubeRay
manifests (`rayVersion`) use: the newest of the range."""
OLDEST_TESTED = "2.55.1"
"""The newest patch of the oldest supported minor: CI runs the Ray tests on it too (make test-ray-oldest)."""
UNSUPPORTED_TESTED = "2.54.1"
"""A Ray just below the range, installed by make test-ray-oldest to see the driver refuse it."""

def is_uri(path: str) -> bool:
    return "://" in path


def run_store(storage: str, name: str) -> tuple[FileSystem, str, str]:
    """(pyarrow filesystem, the run's path on it, the run as the user wrote it, for messages) of the run
    STORAGE/NAME, `ray.storage_path` a filesystem path or a URI."""
    from pyarrow.fs import FileSystem, LocalFileSystem

    fs, base = FileSystem.from_uri(storage) if is_uri(storage) else (LocalFileSystem(), storage)
    return fs, f"{base.rstrip('/')}/{name}", f"{storage.rstrip('/')}/{name}"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


def check_version(version: str | None = None) -> str:
    """The installed Ray version; ConfigError naming the supported range when it is outside it."""
    version = version or importlib.metadata.version("ray")
    lo, hi = SUPPORTED
    if not _version_tuple(lo) <= _version_tuple(version) < _version_tuple(hi):
        raise ConfigError(f"ray {version}: trainapp's Ray launcher supports Ray >={lo},<{hi} (it uses Ray's "
                          f"private API, see trainapp/launch/ray/private/); run a cluster and driver on a "
                          f"Ray in that range, e.g. pip install 'ray[default,train]>={lo},<{hi}'")
    return version


def _check_reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address={address!r}: expected host:port of the Ray head (GCS), "
                          "e.g. 127.0.0.1:6379")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except OSError as e:
        raise ConfigError(f"ray.address={address}: no Ray cluster answers there ({e.strerror or e}); "
                          "start one (make ray-up) or leave ray.address empty for an embedded "
                          "local Ray") from None


def ray_address(ray_cfg: RaySection) -> str:
    """The cluster to join (`ray.address`; '' for an embedded one), checked to answer; also the
    environment an embedded Ray needs, which Ray reads when it is imported: so this runs before anything
    imports ray."""
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS", "")
    if address and address != "auto" and "://" not in address:
        _check_reachable(address)
    if not address:
        # An embedded instance is for this machine only: bind loopback, not the external address
        # (inherited by the processes it starts).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    return address


def check_global_batch(t: TrainSection, most: int) -> None:
    """ConfigError, before any worker starts, when `train.global_batch` is no whole number of micro-batches
    or has fewer of them than the largest group has workers (trainapp/core/layout.py says the same in
    each worker; `most`: `ray.num_workers`' largest group)."""
    if not t.global_batch:
        return
    if t.global_batch % t.batch_size:
        raise ConfigError(f"train.global_batch={t.global_batch}: not a multiple of "
                          f"train.batch_size={t.batch_size}")
    if t.global_batch // t.batch_size < most:
        raise ConfigError(f"train.global_batch={t.global_batch}: {t.global_batch // t.batch_size} "
                          f"micro-batch(es) of train.batch_size={t.batch_size}, fewer than the {most} "
                          f"workers ray.num_workers allows; set it to at least {t.batch_size * most}, or "
                          f"lower train.batch_size")


def worker_needs(ray_cfg: RaySection, use_gpu: bool) -> dict[str, float]:
    """One worker's resources: `ray.resources_per_worker` (default a CPU), a GPU when workers get one."""
    needs = dict(ray_cfg.resources_per_worker) or {"CPU": 1.0}
    if use_gpu:
        needs.setdefault("GPU", 1.0)
    return needs


def check_capacity(ray_cfg: RaySection, needs: dict[str, float]) -> int:
    """How many workers the alive nodes can hold; ConfigError when fewer than the minimum."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    capacity = 0
    for n in nodes:
        res = n.get("Resources", {})
        capacity += min(int(res.get(k, 0) // v) if v > 0 else 10**6 for k, v in needs.items())
    if ray_cfg.check_resources and capacity < ray_cfg.min_workers:
        have = ", ".join(f"{n.get('NodeManagerAddress')}: {int(n.get('Resources', {}).get('CPU', 0))} CPU "
                         f"{int(n.get('Resources', {}).get('GPU', 0))} GPU" for n in nodes)
        raise ConfigError(f"ray.num_workers={ray_cfg.min_workers}: the cluster can hold at most {capacity} "
                          f"workers needing {needs} ({have}); add nodes, lower ray.num_workers, or set "
                          "ray.check_resources=false on an autoscaling cluster")
    return capacity


# ----------------------------------------------------------------------------------------------
# What runs on each node (one Ray task per node)


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
    from trainapp.launch import net

    try:
        res = net.apply(config.NetworkSection(**network), net.ray_head_host(), environ={**os.environ, **env})
        return "", res.summary()
    except net.NetworkError as e:
        return str(e), ""


def probe_node(storage: str | None, network: dict | None, env: dict) -> tuple[str, str, str]:
    """On one node: (the error writing `storage`, the error resolving `network`, the interface it
    resolved); '' for a check that passed or was not asked for (None)."""
    storage_err = _probe_writable(storage) if storage is not None else ""
    net_err, summary = _probe_network(network, env) if network is not None else ("", "")
    return storage_err, net_err, summary


class Preflight:
    """The per-node checks of a run, started on construction and judged by `wait`.

    Every alive node must be able to write a filesystem `storage` (workers write metrics and markers
    there; a URI is written by rank 0 alone). Every node that can hold a worker (a head with no CPUs
    or GPUs trains nothing) must resolve `network.interface` as its workers will, so a node that
    cannot honour it stops the run here, named with what it has, instead of after a worker-group
    start and a process group that never forms. One task per node does both, with no CPU reserved.
    """

    def __init__(self, network_cfg: NetworkSection, env_cfg: dict[str, str], storage: str,
                 timeout_s: float):
        """`network_cfg`: the `network` section; `env_cfg`: `ray.env`, the workers' environment;
        `timeout_s`: `ray.checks_timeout_s`."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.storage, self.nodes = storage, [n for n in ray.nodes() if n.get("Alive")]
        self.timeout_s, self.started = timeout_s, time.monotonic()
        network, env = dataclasses.asdict(network_cfg), dict(env_cfg)
        task = ray.remote(num_cpus=0, max_retries=0)(probe_node)
        self.trains = [n["Resources"].get("CPU", 0) > 0 or n["Resources"].get("GPU", 0) > 0
                       for n in self.nodes]
        self.refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                     .remote(None if is_uri(storage) else storage, network if trains else None, env)
                     for n, trains in zip(self.nodes, self.trains)]

    def wait(self) -> list[str]:
        """One line per training node naming its interface; ConfigError for the first failed check."""
        import ray

        try:
            results: list[Any] = ray.get(self.refs, timeout=max(0.0, self.started + self.timeout_s
                                                                    - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(f"ray.storage_path={self.storage}, network.interface: the checks did not "
                              f"finish on every node within {self.timeout_s:g} s (ray.checks_timeout_s): "
                              "a node that runs no task, or one slower to start the job's runtime env; "
                              "raise ray.checks_timeout_s for the latter") from None
        for n, (err, _, _) in zip(self.nodes, results):
            if err:
                raise ConfigError(f"ray.storage_path={self.storage}: not writable on node "
                                  f"{n['NodeManagerAddress']} {n['NodeID'][:8]} ({err}); use a path every "
                                  "node can write (shared storage) or a URI")
        for n, (_, err, _) in zip(self.nodes, results):
            if err:
                raise ConfigError(f"node {n['NodeManagerAddress']}: {err}")
        return [f"node {n['NodeManagerAddress']}: {summary}"
                for n, trains, (_, _, summary) in zip(self.nodes, self.trains, results) if trains]
