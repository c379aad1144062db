"""Which device a rank trains on (`dist.device`), decided before any process group, and the refusals
that keep a misconfigured GPU node from training somewhere else without a word.

Three mistakes are common on a new GPU cluster and none of them fails by itself: a node whose driver
is too old for the torch wheel (`torch.cuda.is_available()` is False, so the run would train on the
CPU with Gloo), more ranks on a node than GPUs (they would share `cuda:0` until NCCL reports a
duplicate GPU, or not), and a Ray worker given more than one GPU or a fraction of one (its device is
the one Ray chose, `ray.train.torch.get_device()`, not `cuda:LOCAL_RANK`). Each is one line and exit 2.

The facts a decision reads are gathered in `Visible` once, so the rule itself is a pure function a
test can give any machine's facts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from trainapp.errors import ConfigError

NO_DEVICES = ("", "-1", "NoDevFiles")
"""First entries of CUDA_VISIBLE_DEVICES that show a process no GPU (CUDA stops at the first entry it
cannot read; some schedulers write NoDevFiles)."""


@dataclass(frozen=True)
class Visible:
    """What this process can see of CUDA."""

    cuda_available: bool
    device_count: int
    env: Mapping[str, str] = field(default_factory=dict)
    why_not: str = ""
    """When CUDA is unusable: the wheel's CUDA and the driver's, as far as they can be read."""

    @classmethod
    def here(cls) -> Visible:
        available = torch.cuda.is_available()
        return cls(available, torch.cuda.device_count() if available else 0, dict(os.environ),
                   "" if available else cuda_facts())


def cuda_facts(driver_file: str = "/proc/driver/nvidia/version") -> str:
    """Why CUDA may be unusable, in facts: the wheel's CUDA version and the loaded driver's version."""
    wheel = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda}" if torch.version.cuda
             else f"torch {torch.__version__} is a CPU-only build")
    try:
        first = Path(driver_file).read_text().splitlines()[0]
        words = first.split()
        version = next((w for w in words if w[:1].isdigit() and "." in w), first.strip())
        driver = f"NVIDIA driver {version} loaded"
    except (OSError, IndexError):
        driver = "no NVIDIA driver loaded (no /proc/driver/nvidia/version)"
    return f"{wheel}; {driver}"


def allotted(env: Mapping[str, str]) -> str | None:
    """The launcher's word that this process was given GPUs (the setting that says so), or None."""
    gpus = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if gpus and gpus != "0":
        return f"SLURM_GPUS_ON_NODE={gpus}"
    shown = env.get("CUDA_VISIBLE_DEVICES")
    if shown is not None and shown.split(",")[0].strip() not in NO_DEVICES:
        return f"CUDA_VISIBLE_DEVICES={shown}"
    return None


def choose(setting: str, visible: Visible, local_rank: int, local_world_size: int,
           ray_device: Callable[[], torch.device] | None = None) -> tuple[torch.device, str]:
    """(the device this rank trains on, why), or ConfigError naming `dist.device` and the fix.

    `ray_device`: under Ray Train, the device Ray gave this worker (it set CUDA_VISIBLE_DEVICES for the
    GPUs it reserved, which may be several, or a fraction of one shared with other workers)."""
    given = allotted(visible.env)
    if setting == "cpu":
        return torch.device("cpu"), "dist.device=cpu"
    if setting == "auto" and not given and not visible.cuda_available:
        return torch.device("cpu"), "dist.device=auto: no GPU allotted or visible"
    why = f"dist.device={setting}" + (f" ({given})" if given and setting == "auto" else "")
    if not visible.cuda_available:
        shown = visible.env.get("CUDA_VISIBLE_DEVICES")
        if shown is not None and shown.split(",")[0].strip() in NO_DEVICES:
            raise ConfigError(f"{why}: CUDA_VISIBLE_DEVICES={shown!r} hides every GPU from this process; "
                              "unset it, name the GPUs, or set dist.device=cpu")
        raise ConfigError(f"{why}: CUDA is not usable in this process ({visible.why_not or cuda_facts()}); "
                          "install the torch wheel for the node's driver (docker/README.md) or set "
                          "dist.device=cpu")
    if ray_device is not None:
        device = ray_device()
        if device.type != "cuda":
            raise ConfigError(f"{why}: Ray gave this worker no GPU; set ray.use_gpu=true (and GPU in "
                              "ray.resources_per_worker) or dist.device=cpu")
        return device, f"{why}: the GPU Ray reserved for this worker"
    if visible.device_count >= local_world_size:
        return (torch.device("cuda", local_rank),
                f"{why}: GPU {local_rank} of {visible.device_count} on this node")
    if visible.device_count == 1 and "CUDA_VISIBLE_DEVICES" in visible.env:
        # A launcher that shows each process only its own GPU (Slurm --gpus-per-task, a per-rank
        # CUDA_VISIBLE_DEVICES): it is cuda:0 in every process.
        return torch.device("cuda", 0), f"{why}: the one GPU this process is shown ({given})"
    raise ConfigError(f"{why}: {local_world_size} ranks on this node but {visible.device_count} GPU(s) "
                      "visible to them, so ranks would share a GPU; start one rank per GPU (torchrun "
                      f"--nproc-per-node={visible.device_count}) or show each rank its own GPU with "
                      "CUDA_VISIBLE_DEVICES")
