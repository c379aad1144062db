"""What a benchmark ran on, for its result file: the numbers mean little without it (bf16 autocast
is 1.7x faster than fp32 on one CPU of this project's machine type and 12x slower on another)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe() -> str:
    """'x86_64, 2 cores, AMD EPYC (avx2), torch 2.14.1' from /proc/cpuinfo; less where it is missing."""
    model, flags = platform.processor() or platform.system(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    simd = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2") if f in flags][:3]
    text = f"{platform.machine()}, {os.cpu_count()} cores, {model}" + (f" ({', '.join(simd)})" if simd else "")
    try:
        import torch
        text += f", torch {torch.__version__}"
    except ImportError:
        pass
    return text
