"""When a process's start-up phases happened: named wall-clock marks, kept once per name.

A launch is spread over processes (the Ray job driver, Ray Train's workers; torchrun's workers), so
each process marks its own phases on a `Timeline` of its own (a rank's is its guard's), and rank 0
writes them all, with its own, into the attempt's `start` record (`startup`). `bench/launchers.py`
turns them into the start-up and recovery breakdowns. A mark costs a dict insert; nothing here runs per
step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class Timeline:
    """This process's named marks, the first of each name kept."""

    def __init__(self) -> None:
        self._marks: dict[str, float] = {}

    def mark(self, name: str, at: float | None = None) -> None:
        """Remember when `name` happened (now, or `at`); the first mark of a name wins."""
        self._marks.setdefault(name, time.time() if at is None else at)

    def marks(self) -> dict[str, float]:
        return dict(self._marks)

    def mark_process(self, name: str) -> None:
        """Mark `name` at this process's creation time (the interpreter start and imports come after it)."""
        started = process_started()
        if started is not None:
            self.mark(name, started)


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
