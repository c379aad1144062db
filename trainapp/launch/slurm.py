"""`trainapp slurm-preflight`: what slurm/train.sbatch checks on every node before torchrun starts.

A Slurm job fails worst when it fails late: a `run.dir` on node-local disk trains happily and resumes
from nothing after a requeue (each node sees its own directory), and an interface one node lacks
leaves the rendezvous waiting for the full timeout. Both are cheap to see first, in one line:

- `--mark` (the batch script, on the first node): create `run.dir` and write a marker naming this
  job and its restart count.
- every node (one `srun` task each): the marker must be there with this job's name in it (else
  `run.dir` is not storage every node sees), the rendezvous host must resolve, and
  `network.interface` must resolve on this node exactly as training will resolve it (`net.apply`,
  the call training makes, on a copy of the environment: a GLOO_SOCKET_IFNAME set there is checked too).

Exit 2 with one line naming the node, the key and the fix; no torch import (a second, not ten).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from trainapp.config import ConfigError, NetworkSection
from trainapp.launch import net

MARKER = ".slurm-job"
"""File under run.dir that the batch script writes and every node reads back."""


def _job() -> str:
    """This allocation and attempt: a requeued job keeps its id, so the restart count tells them apart."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        raise ConfigError("slurm-preflight: SLURM_JOB_ID is not set; run it inside a Slurm job "
                          "(slurm/train.sbatch does)")
    return f"{job}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def _node() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def mark(run_dir: str | Path) -> Path:
    """Create `run_dir` (`run.dir`) and write the marker; returns its path."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / MARKER
        tmp = path.with_name(f"{MARKER}.{os.getpid()}")
        tmp.write_text(f"{_job()} {_node()}\n")
        tmp.replace(path)
    except OSError as e:
        raise ConfigError(f"run.dir={run_dir}: node {_node()} cannot write there ({e.strerror or e}); "
                          "use a directory on shared storage this user can write") from None
    return path


def check_run_dir(run_dir: str | Path) -> None:
    """ConfigError unless this node reads the marker this job's batch script wrote in `run_dir`."""
    path = Path(run_dir) / MARKER
    want = _job()
    try:
        job, writer = (path.read_text().split() + ["", ""])[:2]
    except FileNotFoundError:
        job, writer = "", ""
    except OSError as e:
        raise ConfigError(f"run.dir={run_dir}: node {_node()} cannot read {path} ({e.strerror or e}); "
                          "use a directory on shared storage every node mounts") from None
    if job != want:
        seen = f"finds {job} from {writer}" if job else "does not see it"
        raise ConfigError(f"run.dir={run_dir}: not storage every node sees: the batch script wrote job "
                          f"{want} to {path}, node {_node()} {seen}; put run.dir on a shared filesystem "
                          "(NFS, Lustre, GPFS) mounted at the same path on every node")


def check_network(network: NetworkSection, rendezvous: str) -> net.Resolution:
    try:
        socket.getaddrinfo(rendezvous, None, socket.AF_INET)
    except OSError as e:
        raise ConfigError(f"rendezvous host {rendezvous} does not resolve on node {_node()} ({e}); "
                          "set RDZV_HOST in slurm/train.sbatch to a name or address every node "
                          "resolves") from None
    try:
        return net.apply(network, rendezvous, environ=dict(os.environ), host=_node())
    except net.NetworkError as e:
        raise ConfigError(f"{e} (NETWORK_INTERFACE in slurm/train.sbatch)") from None


def main(run_dir: str, network: NetworkSection, rendezvous: str | None, write_marker: bool) -> int:
    """The preflight on this node: the marker written (`write_marker`), or `run_dir` (`run.dir`) checked
    shared and, given the `rendezvous` host, the `network` interface chosen."""
    if write_marker:
        print(f"trainapp slurm-preflight: {mark(run_dir)} written by node {_node()}", flush=True)
        return 0
    check_run_dir(run_dir)
    chosen = f": {check_network(network, rendezvous).summary()}" if rendezvous else ""
    print(f"trainapp slurm-preflight: node {_node()} ok: run.dir {run_dir} shared{chosen}", flush=True)
    return 0
