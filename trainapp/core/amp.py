"""Mixed precision: one autocast context and one GradScaler, whatever the dtype.

The scaler is created with `enabled=(dtype is fp16)`: with bf16 or fp32 it is a pass-through, so the
loop has a single code path.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Set as AbstractSet
from pathlib import Path

import torch

from trainapp.config import AmpSection
from trainapp.core import torch_private

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""CPU feature flags (/proc/cpuinfo) of bf16 arithmetic in hardware: AVX512_BF16 and AMX on x86,
BF16 on Arm. oneDNN's own check (`_is_mkldnn_bf16_supported`) also says yes on AVX-512F alone, where
it emulates bf16, and a step is then about 1.5x slower than in fp32 (bench/amp_cpu.py)."""


def native_bf16_flags(cpuinfo: str) -> AbstractSet[str]:
    """The bf16 instruction flags of the first CPU listed in /proc/cpuinfo text (x86 `flags`, Arm
    `Features`)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return BF16_FLAGS & set(value.split())
    return set()


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU does bf16 arithmetic in hardware and this torch build's oneDNN can use it.
    Without a /proc/cpuinfo to read (not Linux) the answer is no: fp32 is never the slow choice."""
    if not torch_private.onednn_bf16():  # a build without oneDNN, or a CPU it cannot run bf16 on
        return False
    try:
        flags = native_bf16_flags(Path(cpuinfo_path).read_text())
    except OSError:
        return False
    return bool(flags)


NATIVE_BF16_CAPABILITY = (8, 0)
"""The first CUDA compute capability with bf16 tensor cores (Ampere). torch's `is_bf16_supported()`
also says yes below it, where bf16 is emulated; `including_emulation=False` is this rule."""


def cuda_auto(capability: tuple[int, int], name: str, hip: bool = False) -> tuple[torch.dtype, str]:
    """`amp.dtype=auto` on a GPU of this compute capability: (the dtype, why)."""
    if hip:
        return torch.bfloat16, f"amp.dtype=auto: bf16 ({name}: ROCm GPUs run bf16)"
    cc = f"compute capability {capability[0]}.{capability[1]}"
    if tuple(capability) >= NATIVE_BF16_CAPABILITY:
        return torch.bfloat16, f"amp.dtype=auto: bf16 ({name}, {cc}: bf16 tensor cores)"
    return torch.float16, (f"amp.dtype=auto: fp16 with loss scaling ({name}, {cc}: no bf16 tensor cores "
                           "before 8.0, Ampere; bf16 would be emulated)")


def resolve_dtype(choice: str, device: torch.device) -> tuple[torch.dtype | None, str]:
    """(the autocast dtype, why). `auto` -> on a GPU bf16 where it has bf16 tensor cores, else fp16 with
    loss scaling; on CPU bf16 where the CPU has bf16 instructions, else None (fp32). `off` -> None."""
    if choice != "auto":
        return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[choice], f"amp.dtype={choice}"
    if device.type == "cuda":
        return cuda_auto(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device),
                         bool(torch.version.hip))
    if cpu_has_native_bf16():
        return torch.bfloat16, "amp.dtype=auto: bf16 (this CPU has bf16 instructions)"
    return None, "amp.dtype=auto: fp32 (this CPU has no bf16 instructions: AVX512_BF16, AMX)"


class Precision:
    def __init__(self, cfg: AmpSection, device: torch.device):
        self.dtype, self.why = resolve_dtype(cfg.dtype, device)
        """The dtype and why it is the one (the `start` record's `amp_why`)."""
        self.note = ""
        """Why the dtype is not what the config suggests, for the run's log."""
        auto = resolve_dtype("auto", device)[0] if cfg.dtype in ("auto", "bf16") else None
        cuda = device.type == "cuda"
        lacks = ("this GPU has no bf16 tensor cores (compute capability < 8.0)" if cuda else
                 "this CPU has no bf16 instructions (AVX512_BF16, AMX)")
        if cfg.dtype == "auto" and not cuda and auto is None:
            self.note = f"amp.dtype=auto: {lacks}, training in fp32"
        elif cfg.dtype == "bf16" and auto is not torch.bfloat16:  # what auto would not pick is emulated
            self.note = (f"amp.dtype=bf16: {lacks}, so bf16 is emulated and slower; amp.dtype=auto trains in "
                         + ("fp16 with loss scaling" if cuda else "fp32"))
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_scale,
                                           enabled=self.dtype is torch.float16)

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def scale_tensor(self) -> torch.Tensor | None:
        """The live loss-scale tensor (no host sync), or None when loss scaling is off."""
        # GradScaler.get_scale() would call .item() every step; its tensor is read only at log time.
        return torch_private.scale_tensor(self.scaler) if self.scaler.is_enabled() else None
