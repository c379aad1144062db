"""Preemption notices: a signal (or a Ray node drain, trainapp/faults/boundary.py) becomes a snapshot
of the step reached.

Two pieces, each with one job:

- `Notices` (one per process, owned by the rank's guard, trainapp/faults/guard.py): handlers for
  SIGTERM, SIGINT and `preempt.signals`, installed from the main thread. The handler only records the
  signal. A watcher thread wakes on the same signal through `signal.set_wakeup_fd`, so it sees the
  signal even while the main thread sits in a blocked collective, logs it, and arms the
  `preempt.grace_s` deadline: if the process has not exited by then, it exits anyway with 128 + the
  signal. The newest valid snapshot is what it was (writes are atomic), and a peer that is gone or hung
  cannot hold the process past the platform's grace period.
- `StopVote` (per run, every rank): about twice a second (at most once a step) the ranks agree
  whether any of them got a signal, so all stop after the same step, and whether it is time to ask
  Ray Train about drained nodes (a barrier every rank must enter at the same step). A vote is an
  asynchronous all-reduce started at one step boundary and read at the next, so the loop never waits
  on it.

The node side of a notice (the worker registry, `trainapp drain` and `trainapp node`) is
trainapp/faults/drain.py.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as tdist

from trainapp.errors import Failure
from trainapp.faults.heartbeat import Heartbeat

if TYPE_CHECKING:
    from trainapp.group import DistContext

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
        for s in nums:
            signal.signal(s, handler)
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


class StopVote:
    """Agrees across ranks on the step to stop at: call `stop(step)` at every step boundary on every rank.

    A vote is an asynchronous all-reduce (MAX) of [this rank's signal number, the step this rank
    proposes for the next vote], started at one boundary and read at the next: it overlaps a step,
    and every rank reads the same answer at the same boundary. Votes come about every `INTERVAL_S`
    (each rank proposes from its own step time; the MAX is what all adopt), every step once steps take
    that long. A vote costs a fraction of a millisecond of CPU (the wake-up of Gloo's thread and a
    round trip; bench/preempt.py measures it): nothing against a 100 ms step, percents against a 5 ms
    one, so the loop votes by time, not by step. Under NCCL the vote runs on a Gloo group of its own, so it
    is a CPU tensor and never synchronises the device.

    With `poll_s` > 0 the vote also carries whether `poll_s` has passed on any rank since the ranks
    last polled: `take_poll()` is then true at the same boundary on every rank (the boundary where
    that vote is read), so a barrier such as `ray.train.get_preemption_info()` goes by time too, without
    a collective of its own. With `pending` (a cheap local check: has this rank been told of a
    notice?) a rank proposes a poll only while `pending()` is true, so the barrier is not paid at all
    until some rank has a notice, and then at the next vote.
    """

    INTERVAL_S = 0.5
    """The stop comes at most this long (plus one step) after a rank saw the signal: well inside any
    platform's grace period."""
    MAX_EVERY = 50

    def __init__(self, ctx: DistContext, notices: Notices, poll_s: float = 0.0,
                 pending: Callable[[], bool] | None = None) -> None:
        self.ctx, self.notices = ctx, notices
        self.group: tdist.ProcessGroup | None = None
        if ctx.distributed and tdist.get_backend() != "gloo":
            self.group = ctx.new_side_group()  # collective: every rank builds the vote together
        self.flag = torch.zeros(3, dtype=torch.int64)
        self.work: tdist.Work | None = None
        self.next_vote = 0  # agreed: the boundary of the next vote
        self.last_t: float | None = None
        self.step_s: float | None = None
        self.poll_s, self.pending = poll_s, pending
        self.polled_t = time.perf_counter()  # the start counts as a poll: a drain seen at once needs none
        self._poll = False  # the ranks agreed to poll at this boundary; cleared by take_poll

    def _poll_due(self, now: float) -> bool:
        return (self.poll_s > 0 and now - self.polled_t >= self.poll_s
                and (self.pending is None or self.pending()))

    def _polls(self, agreed: bool, now: float) -> None:
        if agreed:
            self._poll, self.polled_t = True, now

    def take_poll(self) -> bool:
        """True, once, at a boundary where the ranks agreed to poll (`poll_s`): the same on every rank."""
        poll, self._poll = self._poll, False
        return poll

    def stop(self, step: int) -> int:
        """The agreed signal number at this boundary, 0 to go on (and `take_poll` answers for it)."""
        now = time.perf_counter()
        if not self.ctx.distributed:
            self._polls(self._poll_due(now), now)
            return self.notices.signum
        if self.last_t is not None:
            dt = now - self.last_t
            self.step_s = dt if self.step_s is None else 0.8 * self.step_s + 0.2 * dt
        self.last_t = now
        if self.work is not None:  # started at the previous boundary
            self.work.wait()
            self.work = None
            agreed, self.next_vote, poll = (int(v) for v in self.flag.tolist())
            if agreed:
                return agreed
            self._polls(bool(poll), now)
        if step >= self.next_vote:
            every = 1 if not self.step_s else min(self.MAX_EVERY, max(1, int(self.INTERVAL_S / self.step_s)))
            self.flag[0], self.flag[1], self.flag[2] = self.notices.signum, step + every, self._poll_due(now)
            self.work = tdist.all_reduce(self.flag, op=tdist.ReduceOp.MAX, group=self.group, async_op=True)
        return 0

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the vote in flight (the last boundary's), before the process group goes away; bounded,
        for the case of an error that a peer did not share."""
        if self.work is not None:
            with contextlib.suppress(Exception):
                self.work.wait(datetime.timedelta(seconds=timeout_s))
            self.work = None
