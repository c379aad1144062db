"""glibc malloc settings for a training process (`keep_freed_memory`), under every launcher.

A training step allocates and frees the same activation and gradient buffers, megabytes each, every
step. glibc's malloc hands such memory back to the kernel when it is freed and the next step faults
it back in, page by page, zeroed by the kernel, in some runs thousands of page faults per step,
depending on where malloc's adaptive thresholds happened to settle (docs/benchmarks.md, "Page faults
per step"). It is worst where the loop runs outside the main thread, as under Ray Train: such a
thread gets an arena of 64 MiB heaps that glibc unmaps, or shrinks with MADV_DONTNEED, as soon as
their top is free.
"""

from __future__ import annotations

import ctypes
import platform

# mallopt's parameters (malloc.h).
M_TOP_PAD, M_MMAP_THRESHOLD = -2, -3
TOP_PAD = 64 << 20
"""Freed memory each heap keeps at its top: one whole heap of a thread's arena (64 MiB on 64-bit)."""
MMAP_THRESHOLD = 32 << 20
"""Blocks from this size up get a mapping of their own: where glibc's adaptive threshold stops."""


def keep_freed_memory() -> bool:
    """Have malloc keep up to `TOP_PAD` of freed memory at the top of each heap and serve blocks under
    `MMAP_THRESHOLD` from the heaps, so a step reuses what the previous step freed. Process-wide;
    True where set (glibc), False on other C libraries, which are left alone."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TOP_PAD, TOP_PAD))
