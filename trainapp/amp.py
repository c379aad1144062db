"""Mixed precision: one autocast context and one GradScaler, whatever the dtype.

The scaler is created with `enabled=(dtype is fp16)`: with bf16 or fp32 it is a pass-through, so the
loop has a single code path.
"""

from __future__ import annotations

import contextlib

import torch

from trainapp.config import AmpSection


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bf16 on this CPU's own instructions (AVX-512, AMX). Elsewhere bf16 is
    emulated, and a training step takes several times longer than in fp32 (bench/amp_cpu.py)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """`auto` -> bf16 where supported, else fp16 (CUDA); on CPU bf16 where native, else None (fp32).
    `off` -> None (fp32)."""
    if choice == "off":
        return None
    if choice == "bf16":
        return torch.bfloat16
    if choice == "fp16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else None


class Precision:
    def __init__(self, cfg: AmpSection, device: torch.device):
        self.dtype = resolve_dtype(cfg.dtype, device)
        self.note = ""
        """Why the dtype is not what the config suggests, for the run's log."""
        if device.type == "cpu" and not cpu_has_native_bf16():
            if cfg.dtype == "auto":
                self.note = "amp.dtype=auto: this CPU has no native bf16 (AVX-512/AMX), training in fp32"
            elif cfg.dtype == "bf16":
                self.note = ("amp.dtype=bf16: this CPU has no native bf16 (AVX-512/AMX), so it is emulated and "
                             "several times slower than fp32; amp.dtype=auto or off trains in fp32")
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_scale,
                                           enabled=self.dtype is torch.float16)

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def scale_tensor(self) -> torch.Tensor | None:
        """The live loss-scale tensor (no host sync), or None when loss scaling is off."""
        # GradScaler.get_scale() would call .item() every step; its tensor is read only at log time.
        return self.scaler._scale if self.scaler.is_enabled() else None
