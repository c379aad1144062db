"""What a benchmark ran on, for its result file: the numbers mean little without it (bf16 autocast
is 1.7x faster than fp32 on one CPU of this project's machine type and 12x slower on another)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The instructions that decide whether bf16 is native (AVX-512 BF16, AMX) or emulated (AVX2 only).
SIMD = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ('', set()) where there is none."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                return model, set(value.split())
    except OSError:
        pass
    return model, flags


def simd_flags() -> list[str]:
    flags = _cpuinfo()[1]
    return [f for f in SIMD if f in flags]


def describe() -> str:
    """'x86_64, 2 cores, AMD EPYC (avx2), torch 2.14.1'; less where /proc/cpuinfo is missing."""
    model = _cpuinfo()[0] or platform.processor() or platform.system()
    simd = simd_flags()
    text = (f"{platform.machine()}, {os.cpu_count()} cores, {model}"
            + (f" ({', '.join(simd)})" if simd else ""))
    try:
        import torch
        text += f", torch {torch.__version__}"
    except ImportError:
        pass
    return text
