"""A DataLoader whose worker processes are seen to start: a worker that never reaches Python is killed
and the epoch's workers are started again, instead of the rank waiting on it until the hang watchdog
ends the run.

Why a worker can be stuck at birth: DataLoader forks its workers from the training process, which has
threads (torch's, Gloo's, trainapp's watchers). On CPython 3.8 to 3.11 before the fix of gh-112275, a
fork made while another thread holds the interpreter's thread-list lock (taken, without the GIL, by a
native thread entering Python) gives a child that deadlocks in `PyOS_AfterFork_Child` before any of
its Python code runs. DataLoader's own checks cannot see it (the child is alive), its parent-death
watchdog never runs, and SIGTERM does not end it (the training process's Python-level signal handlers
were inherited and never run). Seen here on Python 3.11.7: 2 forks in 300 deadlocked in a process with
a native thread entering Python in a loop; none on 3.12.1 (docs/how-it-works.md).

A worker counts as started when it ran the loader's `worker_init_fn` (wrapped here: the task's own,
if it has one, runs after). Starting again draws the same worker seeds: the loader's generator is
rewound first.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from typing import Any, Callable

from torch.utils.data import DataLoader

from trainapp.config import ConfigError
from trainapp.core import torch_private

log = logging.getLogger(__name__)

ATTEMPTS = 3
"""Starts of one epoch's workers before the rank gives up with an error."""


class _MarkStarted:
    """A worker's `worker_init_fn`: flags the worker started in memory shared with the training process
    (inherited by the fork), then runs the task's own."""

    def __init__(self, flags: Any, then: Callable[[int], None] | None):
        self.flags, self.then = flags, then

    def __call__(self, worker_id: int) -> None:
        self.flags[worker_id] = 1
        if self.then is not None:
            self.then(worker_id)


class StartCheckedLoader(DataLoader):
    """DataLoader with `data.worker_start_s`: each iteration's workers must start within that many
    seconds, else they are killed and started again (`ATTEMPTS` in all)."""

    def __init__(self, *args: Any, start_s: float, **kwargs: Any):
        workers = int(kwargs.get("num_workers", 0))
        self._started = multiprocessing.RawArray("b", max(1, workers))
        kwargs["worker_init_fn"] = _MarkStarted(self._started, kwargs.get("worker_init_fn"))
        super().__init__(*args, **kwargs)
        self.start_s = start_s

    def __iter__(self) -> Any:  # torch's iterator class is private (trainapp/core/torch_private.py)
        if self.num_workers == 0 or self.persistent_workers:
            return super().__iter__()
        seed_state = self.generator.get_state() if self.generator is not None else None
        for attempt in range(1, ATTEMPTS + 1):
            self._started[:] = bytes(len(self._started))
            it = super().__iter__()
            missing = self._wait_for_workers()
            if not missing:
                return it
            # Off torch's SIGCHLD check first: it would raise here on a worker killed while it watches it.
            workers = torch_private.loader_workers(it)
            torch_private.unwatch_loader_workers(it)
            for i in missing:
                workers[i].kill()  # SIGKILL: the stuck child runs no handler (its inherited ones never ran)
                workers[i].join(timeout=5)
            del it  # its shutdown ends the workers that did start
            log.warning("data: DataLoader worker(s) %s did not start in data.worker_start_s=%g s (a fork "
                        "deadlock of Python < 3.12, CPython gh-112275); killed them, starting the loader's "
                        "workers again (attempt %d of %d)", missing, self.start_s, attempt + 1, ATTEMPTS)
            if seed_state is not None:
                assert self.generator is not None
                self.generator.set_state(seed_state)
        raise ConfigError(f"data.worker_start_s={self.start_s:g}: the DataLoader workers did not start "
                          f"{ATTEMPTS} times in a row; raise data.worker_start_s on a loaded machine, or "
                          "set data.num_workers=0")

    def _wait_for_workers(self) -> list[int]:
        """The workers that have not started by the deadline ([] once all have)."""
        deadline = time.monotonic() + self.start_s
        pause = 0.001
        while True:
            missing = [i for i in range(self.num_workers) if not self._started[i]]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(pause)
            pause = min(0.05, pause * 2)
