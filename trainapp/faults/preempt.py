"""Preemption notices: a signal (or a Ray node drain, trainapp/faults/boundary.py) becomes a snapshot
of the step reached.

`Notices` (one per process, owned by the rank's guard, trainapp/faults/guard.py): handlers for
SIGTERM, SIGINT and `preempt.signals`, installed from the main thread. The handler only records the
signal. A watcher thread wakes on the same signal through `signal.set_wakeup_fd`, so it sees the
signal even while the main thread sits in a blocked collective, logs it, and arms the
`preempt.grace_s` deadline: if the process has not exited by then, it exits anyway with 128 + the
signal. The newest valid snapshot is what it was (writes are atomic), and a peer that is gone or hung
cannot hold the process past the platform's grace period. How the ranks agree on the step to stop at
is the step boundary's (`StopVote`, trainapp/faults/boundary.py); how a stop ends a rank, the
exceptions here.

The node side of a notice (the worker registry, `trainapp drain` and `trainapp node`) is
trainapp/faults/drain.py.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable

from trainapp.errors import Failure
from trainapp.faults.heartbeat import Heartbeat

log = logging.getLogger(__name__)

ALWAYS = ("SIGTERM", "SIGINT")


class Preempted(Failure):
    """Raised out of the training loop on every rank once the stop step's snapshot is written."""

    cause = ""  # a handled notice, on record as `preempted`, not a failure

    def __init__(self, signum: int, step: int, seconds: float, snapshot: str | None, rank: int = 0):
        self.signum, self.step, self.seconds, self.snapshot, self.rank = signum, step, seconds, snapshot, rank
        self.exit_code = 128 + signum
        super().__init__(self.line())

    def line(self) -> str:
        return (f"trainapp: preempted ({signal.Signals(self.signum).name}) at step {self.step} after "
                f"{self.seconds:.1f} s; snapshot {self.snapshot}; rerun the same command to resume")


class Stopped(Preempted):
    """A stop the run's holder asked for (`ray job stop` to the driver, Ctrl-C of a driver in the
    foreground): the same agreed step and snapshot as a preemption, on record as `stopped`; the workers
    then end normally, so Ray Train ends the run instead of restarting it."""

    def __init__(self, signum: int, step: int, seconds: float, snapshot: str | None, rank: int = 0,
                 by: str = ""):
        self.by = by
        super().__init__(signum, step, seconds, snapshot, rank)

    def line(self) -> str:
        return (f"trainapp: stopped ({self.by}) at step {self.step} after {self.seconds:.1f} s; snapshot "
                f"{self.snapshot}; submit again with the same ray.name to resume there")


class Resized(Preempted):
    """A live resize of the worker group (Ray Train's elastic policy, trainapp/launch/ray/resize.py): the
    same agreed step and snapshot as a preemption, on record as `resized`; the workers then wait for Ray
    Train to replace the group, which resumes from that snapshot."""

    def __init__(self, signum: int, step: int, seconds: float, snapshot: str | None, rank: int = 0,
                 by: str = ""):
        self.by = by
        super().__init__(signum, step, seconds, snapshot, rank)

    def line(self) -> str:
        return (f"trainapp: {self.by}: snapshot of step {self.step} after {self.seconds:.1f} s "
                f"({self.snapshot}); the new worker group resumes there")


class StoppedBeforeStart(Failure):
    """A stop the run's holder asked for before this attempt trained a step: nothing new to save; the
    workers end normally."""

    cause = ""
    exit_code = 0


class Notices:
    """This process's preemption notices: the first signal, when it came, and the deadline armed on it.
    `expire(cause, error, code)` ends the process when the deadline runs out or a notice comes before
    any step (the guard's failure log)."""

    def __init__(self, heartbeat: Heartbeat, expire: Callable[[str, str, int], None],
                 grace_s: float = 25.0) -> None:
        self.heartbeat, self.expire, self.grace_s = heartbeat, expire, grace_s
        self.signum = 0
        """The signal number of the first notice, 0 if none."""
        self.at = 0.0  # time.monotonic() of the first signal
        self.signals: set[int] = set()
        self.before: dict[int, Any] = {}
        """The handler each signal had before `install` (restored in forked children)."""
        self.watching = False
        self.armed = False
        self.lock = threading.Lock()
        self.snapshots = "the run's snapshots directory"
        """What the deadline's message names as the snapshots left intact."""
        self.phase_at_signal = ""  # the heartbeat's phase when the first signal came
        self.done = False  # this process's training is over (a Ray worker lives on): signals are not notices
        self.stop_by = ""
        """Who asked for a stop that came as no signal to this process (`request`): '' for a signal."""
        self.stop_kind = ""
        """What such a stop is for: `stop` (the run ends) or `resize` (the group is replaced)."""

    def seconds_since(self) -> float:
        return time.monotonic() - self.at if self.signum else 0.0

    def training_over(self) -> None:
        """Training in this process is over (finished, failed or stopped): from now on a signal is not
        a notice, it ends the process as it would without trainapp (Ray stops a finished worker group
        with SIGTERM: no "stopping after the next step" then)."""
        self.done = True

    def install(self, names: list[str], grace_s: float, handler: Callable) -> bool:
        """Handle SIGTERM, SIGINT and `names` as preemption notices in this process with `handler` (which
        calls `handle`). Call from the main thread (Python delivers signals there); False, with a
        warning, where that is impossible."""
        self.grace_s = grace_s
        nums = {signal.Signals[n] for n in (*ALWAYS, *names)}
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption: signal handlers can only be installed from the main thread; %s will end "
                        "this process without a snapshot", ", ".join(sorted(n.name for n in nums)))
            return False
        if not self.before:  # the first install in this process
            os.register_at_fork(after_in_child=self._not_in_children)
        for s in nums:
            self.before.setdefault(int(s), signal.signal(s, handler))
        self.signals = {int(s) for s in nums}
        if not self.watching:
            r, w = os.pipe()
            os.set_blocking(w, False)
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            if old != -1:  # someone else's wakeup fd (an asyncio loop in this thread): leave it theirs
                signal.set_wakeup_fd(old)
                os.close(r)
                os.close(w)
            else:
                threading.Thread(target=self._watch, args=(r,), name="preempt-watch", daemon=True).start()
                self.watching = True
        return True

    def _not_in_children(self) -> None:
        """In a child forked from this process (a DataLoader worker): the handlers this process had before
        `install`, and no wakeup fd. The child shares the watcher's pipe: a signal to it (torch ends a
        worker that did not stop in time with SIGTERM) would otherwise read as a notice to this process."""
        try:
            signal.set_wakeup_fd(-1)
            for s, before in self.before.items():
                signal.signal(s, before if before is not None else signal.SIG_DFL)
        except ValueError:  # forked from another thread than the main one: signal.signal refuses
            pass

    def _record(self, signum: int) -> None:
        if not self.signum:
            self.at, self.phase_at_signal = time.monotonic(), self.heartbeat.phase
            self.signum = signum

    def handle(self, signum: int) -> None:
        """The signal handler's work. Runs in the main thread between bytecodes: record only; logging here
        could deadlock on a lock the interrupted code holds. The watcher thread arms the deadline (here
        only without one)."""
        if self.done:  # no training left to save: the signal does what it would without us
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._record(signum)
        if not self.watching:
            self._arm(signum)

    def request(self, signum: int, by: str, kind: str = "stop") -> None:
        """A stop asked for through the run's lease (`by`: who asked, e.g. `ray job stop`; `kind`: `stop`
        or `resize`), handled as the signal `signum` would be, from any thread: every rank stops after
        the same step, with a snapshot."""
        if self.done or self.signum:
            return
        self.stop_by, self.stop_kind = by, kind
        self._record(signum)
        self._arm(signum)

    def _arm(self, signum: int) -> None:
        """First notice: log it and start the deadline; later ones: say they change nothing."""
        if self.done:
            return
        with self.lock:
            first = not self.armed
            self.armed = True
            # The watcher may see a signal before the blocked main thread runs the handler.
            self._record(signum)
        name = signal.Signals(signum).name
        if first and self.heartbeat.phase == "start":  # no step trained yet in this process: nothing to save
            self.expire("signal", f"{name} before training started; nothing to save", 128 + signum)
            return
        if not first:
            log.warning("preemption: %s again; already stopping (the snapshot is on its way; exit at the "
                        "latest %.0f s after the first notice)", name, self.grace_s)
            return
        what = f"stop asked for by {self.stop_by}" if self.stop_by else f"preemption: {name} received"
        log.warning("%s; stopping after the next step with a snapshot (preempt.grace_s=%g)", what,
                    self.grace_s)
        timer = threading.Timer(max(0.0, self.grace_s - self.seconds_since()), self._deadline)
        timer.daemon = True
        timer.start()

    def _deadline(self) -> None:
        self.expire("signal", f"{signal.Signals(self.signum).name}: preempt.grace_s={self.grace_s:g} ran out "
                    f"before the stop was agreed and its snapshot written (a peer gone or hung?); the newest "
                    f"valid snapshot in {self.snapshots} is unchanged", 128 + self.signum)

    def _watch(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in self.signals:
                    self._arm(signum)
