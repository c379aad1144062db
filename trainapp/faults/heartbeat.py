"""The training thread's heartbeat and the watchdog that finds a hung rank in a minute.

The training thread beats at every step, data fetch, eval batch and snapshot chunk (`beat`: two
attribute stores, nothing more) and marks what it does (`phase`). A watchdog thread fires when no beat
came for `fault.hang_timeout_s` (`fault.hang_startup_s` until the first step is done): it writes every
thread's Python stack (faulthandler) to `run.dir/hangs/rank-R-attempt-A.txt`, prints one line naming
the rank, host, last step and phase, and exits with `HUNG_EXIT`, so the launcher restarts the group
(torchrun `--max-restarts`, Ray's `FailureConfig`) and the run resumes from its snapshot.

A rank blocked in a collective because a peer hangs stops beating too, so the healthy ranks find the
hang as well. The exception: ranks other than 0 waiting for rank 0's snapshot write (`snapshot` phase)
do not count the wait; rank 0's own watchdog watches the write, chunk by chunk. The process-group
timeout (`dist.timeout_s`) stays as the backstop.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import threading
import time
from pathlib import Path

HUNG_EXIT = 124
"""Exit code of a rank the watchdog ended (as GNU timeout's): not 0, not 2, 3 or 128+N."""


class _State:
    def __init__(self) -> None:
        self.last = time.monotonic()
        self.phase = "start"  # start, data, step, eval, snapshot
        self.step = 0
        self.owner: int | None = None  # the training thread (the one that started the watchdog)
        self.aside = 0.0  # the last progress of another thread (the background snapshot writer)


state = _State()


def beat(step: int | None = None) -> None:
    state.last = time.monotonic()
    if step is not None:
        state.step = step


def progress() -> None:
    """A beat from code that also runs in other threads (a snapshot chunk). From another thread it is
    only noted aside: an asynchronous write must not hide that the training thread hangs, and the
    training thread, when it waits for that write, beats while the write progresses (`wait_for`)."""
    if state.owner is None or threading.get_ident() == state.owner:
        state.last = time.monotonic()
    else:
        state.aside = time.monotonic()


def wait_for(thread: threading.Thread, poll_s: float = 0.5) -> None:
    """Join `thread` from the training thread, beating while it makes progress: a writer that stops
    making progress leaves the training thread silent, and the watchdog finds it."""
    seen = state.aside
    while thread.is_alive():
        thread.join(poll_s)
        if state.aside != seen:
            seen = state.aside
            beat()


def set_phase(name: str) -> None:
    state.phase = name
    state.last = time.monotonic()


@contextlib.contextmanager
def phase(name: str):
    """Mark what the training thread does inside the block (named by the watchdog and the preemption record)."""
    before = state.phase
    set_phase(name)
    try:
        yield
    finally:
        set_phase(before)


class Watchdog:
    """Fires when the training thread has not beaten for `timeout_s` (`startup_s` before the first step)."""

    def __init__(self, timeout_s: float, startup_s: float, run_dir: Path, rank: int, attempt: int):
        self.timeout_s, self.startup_s = timeout_s, startup_s
        self.path = Path(run_dir) / "hangs" / f"rank-{rank}-attempt-{attempt}.txt"
        self.rank = rank
        self._first_step: int | None = None  # the step the run started at; past it, the normal timeout applies
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        if self.timeout_s > 0:
            state.owner = threading.get_ident()
            self._first_step = state.step
            beat()
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _allowance(self) -> float | None:
        if self.rank != 0 and state.phase == "snapshot":
            return None  # waiting for rank 0's write, which rank 0's watchdog watches
        started = state.step != self._first_step  # a step was done since start()
        return self.timeout_s if started else max(self.startup_s, self.timeout_s)

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            allowance = self._allowance()
            silent = time.monotonic() - state.last
            if allowance is not None and silent > allowance:
                self._fire(silent)

    def _fire(self, silent: float) -> None:
        from trainapp.faults import failure  # here: failure reads this module's state

        error = (f"no progress for {silent:.0f} s (fault.hang_timeout_s={self.timeout_s:g}); stacks in "
                 f"{self.path}; the launcher restarts the group from the newest snapshot")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w") as f:
                f.write(failure.line_for("hang", error, HUNG_EXIT) + "\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:
            error += f" (could not write the stacks: {e})"
        failure.record("hang", error, HUNG_EXIT, silent_s=round(silent, 1))
        os._exit(HUNG_EXIT)
