"""The training thread's heartbeat and the watchdog that finds a hung rank in a minute.

The training thread beats at every step, data fetch, eval batch and snapshot chunk (`beat`: two
attribute stores, nothing more) and marks what it does (`set_phase`, called by the phase clock that
also times the phases: trainapp/observe/timings.py). A watchdog thread fires when no beat came for
`fault.hang_timeout_s` (`fault.hang_startup_s` until the first step is done) and calls its `fire`
(trainapp/faults/guard.py), which writes every thread's Python stack (faulthandler) to
`run.dir/hangs/rank-R-attempt-A.txt`, records the hang and ends the process with exit 124, so the
launcher restarts the group (torchrun `--max-restarts`, Ray's `FailureConfig`) and the run resumes from
its snapshot.

A rank blocked in a collective because a peer hangs stops beating too, so the healthy ranks find the
hang as well, `PEER_FIRST_S` after the hung rank would: a rank whose silence is a wait on its peers
(`PEER_WAIT_PHASES`) gives the rank that hangs the first word. Under Ray Train the controller stops the
whole group once one worker has exited, so whoever records first may be the only one on record, and it
should be the rank that hung, not the one waiting for it. The exception: ranks other than 0 waiting for
rank 0's snapshot write (`snapshot` phase) do not count the wait; rank 0's own watchdog watches the
write, chunk by chunk. A sharded snapshot's shards are written by every rank in one
torch.distributed.checkpoint call that reports no progress: while it moves bytes, a thread beats for the
training thread (`writing`). The process-group timeout (`dist.timeout_s`) stays as the backstop.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator


PEER_WAIT_PHASES = ("compute", "optim", "step")
"""Phases in which a rank's silence may be a wait for a peer: a collective of the forward and backward
(DDP's gradient all-reduce, FSDP's all-gathers and reduce-scatters), FSDP's gradient-norm all-reduce
(`step`: how records before the phase clock named the step). `trainapp report` puts a hang found in one
of them after the others' records: that rank was most often waiting for the one that hung."""
PEER_FIRST_S = 2.0
"""Extra silence a rank in `PEER_WAIT_PHASES` allows before it records a hang: the hung rank's watchdog
ticks within a second of its own timeout and posts its failure, and this rank's failure watch
(trainapp/faults/failure.py) sees the post within another second and records `peer` instead."""


class Heartbeat:
    """What the training thread did last, and when: read by the watchdog, the failure records and the
    preemption record."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.phase = "start"  # start, then the phase clock's: data, compute, optim, other, eval, snapshot
        self.step = 0
        self.owner: int | None = None  # the training thread (the one that started the watchdog)
        self.aside = 0.0  # the last progress of another thread (the background snapshot writer)

    def beat(self, step: int | None = None) -> None:
        self.last = time.monotonic()
        if step is not None:
            self.step = step

    def progress(self) -> None:
        """A beat from code that also runs in other threads (a snapshot chunk). From another thread it
        is only noted aside: an asynchronous write must not hide that the training thread hangs, and
        the training thread, when it waits for that write, beats while the write progresses
        (`wait_for`)."""
        if self.owner is None or threading.get_ident() == self.owner:
            self.last = time.monotonic()
        else:
            self.aside = time.monotonic()

    def wait_for(self, thread: threading.Thread, poll_s: float = 0.5) -> None:
        """Join `thread` from the training thread, beating while it makes progress: a writer that stops
        making progress leaves the training thread silent, and the watchdog finds it."""
        seen = self.aside
        while thread.is_alive():
            thread.join(poll_s)
            if self.aside != seen:
                seen = self.aside
                self.beat()

    @contextlib.contextmanager
    def writing(self, where: Path, poll_s: float = 0.5) -> Iterator[None]:
        """Inside the block the training thread writes a snapshot's shards into `where`, in one call of
        torch.distributed.checkpoint that reports no progress and that every rank's write holds up (a
        collective): a thread beats for it while the bytes move, so a write slower than
        `fault.hang_timeout_s` is no hang, and one that stops moving bytes is found as any silence is.

        The bytes: the files under `where` (every rank's shards, in one directory every rank sees: rank 0,
        whose watchdog watches the snapshot phase, sees a slow peer's shard grow too) and this thread's own
        reads and writes (the checksums of its files). No ceiling on the whole write: a write that still
        moves bytes is progressing however long it takes, while a stuck one (a lost file server, a stopped
        peer) goes silent and is found `fault.hang_timeout_s` after its last byte. The fsync of each file
        moves none: on a disk that takes longer than the timeout to flush one shard, raise the timeout."""
        stop = threading.Event()
        watcher = threading.Thread(target=self._beat_while_moving,
                                   args=(where, threading.get_native_id(), stop, poll_s),
                                   name="shard-write-beats", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()

    def _beat_while_moving(self, where: Path, tid: int, stop: threading.Event, poll_s: float) -> None:
        seen = _bytes_moved(where, tid)
        while not stop.wait(poll_s):
            now = _bytes_moved(where, tid)
            if now != seen:
                seen = now
                self.last = time.monotonic()  # the training thread's beat: it is the one writing

    def set_phase(self, name: str) -> None:
        self.phase = name
        self.last = time.monotonic()

    @contextlib.contextmanager
    def phase_of(self, name: str) -> Iterator[None]:
        """Mark what the training thread does inside the block (code outside the step's phase clock)."""
        before = self.phase
        self.set_phase(name)
        try:
            yield
        finally:
            self.set_phase(before)


class Watchdog:
    """Fires when the training thread has not beaten for `timeout_s` (`startup_s` before the first
    step): `fire(silent_s)` runs in the watchdog's thread (it writes the stacks with `dump_stacks`)."""

    def __init__(self, heartbeat: Heartbeat, timeout_s: float, startup_s: float, path: Path, rank: int,
                 fire: Callable[[float], None]):
        self.heartbeat, self.timeout_s, self.startup_s = heartbeat, timeout_s, startup_s
        self.path, self.rank, self.fire = path, rank, fire
        # The step the run started at; past it, the normal timeout applies.
        self._first_step: int | None = None
        self._stop = threading.Event()

    def start(self) -> Watchdog:
        if self.timeout_s > 0:
            self.heartbeat.owner = threading.get_ident()
            self._first_step = self.heartbeat.step
            self.heartbeat.beat()
            threading.Thread(target=self._watch, name="hang-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _allowance(self) -> float | None:
        if self.rank != 0 and self.heartbeat.phase == "snapshot":
            return None  # waiting for rank 0's write, which rank 0's watchdog watches
        started = self.heartbeat.step != self._first_step  # a step was done since start()
        allowance = self.timeout_s if started else max(self.startup_s, self.timeout_s)
        return allowance + (PEER_FIRST_S if self.heartbeat.phase in PEER_WAIT_PHASES else 0.0)

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            allowance = self._allowance()
            silent = time.monotonic() - self.heartbeat.last
            if allowance is not None and silent > allowance:
                self.fire(silent)

    def dump_stacks(self, headline: str) -> str:
        """`headline`, then every thread's stack, into `path`; '' when written, else why not."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w") as f:
                f.write(headline + "\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:
            return f" (could not write the stacks: {e})"
        return ""


def _bytes_moved(where: Path, tid: int) -> tuple[int, int]:
    """(bytes of the files under `where`, bytes the thread `tid` of this process read and wrote so far):
    either grows while a write progresses. 0 for what cannot be read (no /proc: the files alone)."""
    size = 0
    for root, _, files in os.walk(where):
        for name in files:
            with contextlib.suppress(OSError):  # renamed or removed meanwhile
                size += os.stat(os.path.join(root, name)).st_size
    io = 0
    with contextlib.suppress(OSError, ValueError):
        fields = dict(line.split(": ") for line in Path(f"/proc/self/task/{tid}/io").read_text().splitlines())
        io = int(fields["rchar"]) + int(fields["wchar"])
    return size, io
