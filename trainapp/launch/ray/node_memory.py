"""A node's memory as Ray's memory monitor sees it, for the spares (trainapp/launch/ray/spares.py): the
Raylet ends worker processes once the node's used memory passes `RAY_memory_usage_threshold` (0.95) of
its total, and an idle spare holds hundreds of megabytes. On a node sized for its training worker alone
(a pod with a tight memory limit) a spare would push that worker over: the spares ask for no more than
the node has room for.

Used and total follow Ray's own rule (its `get_cgroup_mem_stats`, which its C++ monitor mirrors): in a
memory cgroup, the cgroup's usage less its file cache, against the cgroup's limit capped at the machine's
memory; elsewhere the machine's. Read here from the same files rather than through Ray's private
functions, whose module moves between the Ray releases of the supported range.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
THRESHOLD_ENV = "RAY_memory_usage_threshold"
THRESHOLD = 0.95
"""Ray's default for `RAY_memory_usage_threshold`."""
REFRESH_ENV = "RAY_memory_monitor_refresh_ms"
"""0 there turns Ray's memory monitor off (its processes are then ended by the kernel only)."""


@dataclass(frozen=True)
class Memory:
    used: int
    """Bytes in use, as Ray's monitor counts them."""
    total: int
    """The bytes the monitor's threshold is a fraction of."""


def read(root: Path = CGROUP) -> Memory:
    """This node's (this container's) memory now."""
    import psutil

    machine = psutil.virtual_memory()
    for usage, stat, limit, prefix in (("memory/memory.usage_in_bytes", "memory/memory.stat",
                                        "memory/memory.limit_in_bytes", "total_"),
                                       ("memory.current", "memory.stat", "memory.max", "")):
        try:
            stats = dict(line.split(maxsplit=1) for line in (root / stat).read_text().splitlines() if line)
            used = (int((root / usage).read_text()) - int(stats[f"{prefix}inactive_file"])
                    - int(stats[f"{prefix}active_file"]))
        except (OSError, KeyError, ValueError):
            continue
        try:
            total = min(int((root / limit).read_text()), machine.total)
        except (OSError, ValueError):  # cgroup v2's "max": no limit
            total = machine.total
        return Memory(used, total)
    return Memory(machine.used, machine.total)


def kill_at() -> float:
    """The fraction of `Memory.total` at which Ray starts ending processes (1.0: its monitor is off).
    Ray's workers inherit the Raylet's environment, so this process sees the value it runs with."""
    if os.environ.get(REFRESH_ENV, "").strip() == "0":
        return 1.0
    try:
        return float(os.environ.get(THRESHOLD_ENV, THRESHOLD))
    except ValueError:
        return THRESHOLD


def private_bytes(pid: int | None = None) -> int:
    """A process's private memory (USS): what ending it would give back."""
    import psutil

    return int(psutil.Process(pid).memory_full_info().uss)
