"""`python -m trainapp doctor`: what this node would do with a config, checked before a run needs it.

Every check gives ok / warn / FAIL and one line of detail; the command exits 1 when any check fails.
It starts no process group and sends no traffic except a TCP connect to the rendezvous or Ray head.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from trainapp.config import Config
from trainapp.launch import net

OK, WARN, FAIL = "ok", "warn", "FAIL"
# DataLoader batches wait in shared memory: `prefetch_factor` (2) per worker, float32 images.
_PREFETCH = 2


@dataclass
class Check:
    name: str
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<5} {self.name:<12} {self.detail}"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_versions() -> list[Check]:
    import torch

    cuda = torch.version.cuda
    out = [Check("torch", OK, f"{torch.__version__} ({f'CUDA {cuda} build' if cuda else 'CPU-only build'})"),
           Check("ray", OK, _version("ray"))]
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out.append(Check("gpus", OK, f"{len(names)}: {', '.join(names)}; NCCL {nccl}; backend nccl"))
    else:
        out.append(Check("gpus", OK, "none visible: training runs on CPU with backend gloo"))
    return out


def check_device(cfg: Config) -> Check:
    """The device a rank of this node would train on (`dist.device`), or the line that would stop it."""
    from trainapp.errors import ConfigError
    from trainapp.launch import device

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    try:
        chosen, why = device.choose(cfg.dist.device, device.Visible.here(), 0, local)
    except ConfigError as e:
        return Check("device", FAIL, str(e))
    return Check("device", OK, f"{chosen} ({why})")


def rendezvous(cfg: Config) -> tuple[str | None, int | None, str]:
    """(host, port, what it is): MASTER_ADDR under torchrun, else the Ray head, else none."""
    if os.environ.get("MASTER_ADDR"):
        port = os.environ.get("MASTER_PORT", "")
        return os.environ["MASTER_ADDR"], int(port) if port.isdigit() else None, "MASTER_ADDR"
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    address = address.split("://", 1)[-1]
    if address and address != "auto":
        host, _, port = address.rpartition(":")
        if "RAY_ADDRESS" in os.environ and not cfg.ray.address and port == "8265":
            return host, None, "the Ray head (from RAY_ADDRESS, the job API)"
        return host or address, int(port) if port.isdigit() else None, "the Ray head"
    return None, None, "none (a single process)"


def check_network(cfg: Config) -> list[Check]:
    ifaces = net.interfaces()
    out = [Check("interfaces", OK, net.describe_all(ifaces))]
    host, port, what = rendezvous(cfg)
    try:
        res = net.resolve(cfg.network.interface, host, ifaces)
        where = f"rendezvous {host} ({what})" if host else "no rendezvous address (a single process)"
        out.append(Check("interface", OK, f"{where}: {res.summary()}"))
    except net.NetworkError as e:
        out.append(Check("interface", FAIL, str(e)))
    for key in (net.NCCL_IFNAME, net.GLOO_IFNAME):
        if key in os.environ:
            out.append(Check("environment", WARN,
                             f"{key}={os.environ[key]} is set and wins over network.interface"))
    if host and port:
        try:
            with socket.create_connection((host, port), timeout=3):
                out.append(Check("rendezvous", OK, f"{host}:{port} ({what}) accepts connections"))
        except ConnectionRefusedError:
            out.append(Check("rendezvous", WARN, f"{host}:{port} ({what}): reachable, but nothing listens "
                                                 "yet (fine before rank 0 / the head starts)"))
        except OSError as e:
            out.append(Check("rendezvous", FAIL, f"{host}:{port} ({what}): {e.strerror or e}; check the "
                                                 "address, routes and firewalls between the nodes"))
    return out


def shm_needed(cfg: Config, local_procs: int) -> int:
    """Bytes of /dev/shm the DataLoader workers of this node's training processes hold at most."""
    image = 3 * cfg.data.image_size ** 2 * 4
    return local_procs * cfg.data.num_workers * _PREFETCH * cfg.train.batch_size * image


def check_shm(cfg: Config) -> Check:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or max(1, _gpu_count())
    need = shm_needed(cfg, local)
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return Check("shm", WARN if need == 0 else FAIL, "no /dev/shm on this host")
    detail = (f"/dev/shm {usage.total / 2**20:.0f} MiB, {usage.free / 2**20:.0f} MiB free; DataLoader "
              f"workers need ~{need / 2**20:.0f} MiB ({local} process(es) x "
              f"data.num_workers={cfg.data.num_workers} x {_PREFETCH} batches of {cfg.train.batch_size})")
    if need > usage.free:
        return Check("shm", FAIL, detail + "; raise the container's shm size (--shm-size, a Memory emptyDir) "
                                           "or lower data.num_workers")
    return Check("shm", OK, detail)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_writable(key: str, path: str) -> Check:
    if "://" in path:
        return Check("storage", OK, f"{key}={path}: a URI, checked by Ray when the run starts")
    p = Path(path).expanduser().resolve()
    existing = next((q for q in [p, *p.parents] if q.exists()), None)
    if existing is None or not existing.is_dir():
        return Check("storage", FAIL, f"{key}={path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        return Check("storage", FAIL, f"{key}={path}: {existing} is not writable by uid {os.getuid()}")
    if existing == p:
        probe = p / f".doctor-{uuid.uuid4().hex[:8]}"
        try:
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            return Check("storage", FAIL, f"{key}={path}: cannot write a file there ({e.strerror or e})")
        return Check("storage", OK, f"{key}={path}: writable")
    return Check("storage", OK, f"{key}={path}: will be created under writable {existing}")


def check_task(cfg: Config) -> Check:
    """The task `task.name` names, made here as a training process would make it (its module imported
    on this node, its `task.args` taken, its methods there); nothing of it runs."""
    from trainapp.errors import ConfigError
    from trainapp.tasks.load import resolve

    try:
        task = resolve(cfg)
    except ConfigError as e:
        return Check("task", FAIL, str(e))
    return Check("task", OK, f"{cfg.task.name} ({type(task).__module__}.{type(task).__qualname__})")


def check_lease(cfg: Config) -> Check:
    """Who holds run.dir's lease (docs/run-directory.md): a warning when a run is using it now."""
    from trainapp.snapshots import lease

    if cfg.run.lease_s <= 0:
        return Check("lease", WARN,
                     "run.lease_s=0: no lease; two runs on one run.dir would mix their snapshots")
    try:
        said = lease.status(cfg.run.dir)
    except OSError as e:
        return Check("lease", WARN, f"run.dir={cfg.run.dir}: cannot read its lease ({e.strerror or e})")
    return Check("lease", WARN if said.startswith("in use") else OK, f"run.dir={cfg.run.dir}: {said}")


def run(cfg: Config) -> list[Check]:
    checks = [*check_versions(), check_device(cfg), check_task(cfg), *check_network(cfg), check_shm(cfg),
              check_writable("run.dir", cfg.run.dir), check_lease(cfg),
              check_writable("ray.storage_path", cfg.ray.storage_path)]
    return checks


def as_json(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
