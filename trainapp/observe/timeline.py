"""When a process's start-up phases happened: named wall-clock marks, kept once per name.

A launch is spread over processes (the Ray job driver, Ray Train's workers; torchrun's workers), so
each process marks its own phases and rank 0 writes them all, with its own, into the attempt's
`start` record (`startup`). `bench/launchers.py` turns them into the start-up and recovery
breakdowns. A mark costs a dict insert; nothing here runs per step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_marks: dict[str, float] = {}


def mark(name: str, at: float | None = None) -> None:
    """Remember when `name` happened (now, or `at`); the first mark of a name wins."""
    _marks.setdefault(name, time.time() if at is None else at)


def marks() -> dict[str, float]:
    return dict(_marks)


def process_started(pid: int | None = None) -> float | None:
    """Wall-clock time the process was created, to the clock tick (10 ms); None where /proc cannot
    say. /proc gives the start in ticks since boot; now less the time since then (the boot clock,
    not /proc/stat's btime, which is whole seconds)."""
    try:
        stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def mark_process(name: str) -> None:
    """Mark `name` at this process's creation time (the interpreter start and imports come after it)."""
    started = process_started()
    if started is not None:
        mark(name, started)
