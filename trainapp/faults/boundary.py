"""The step boundary: asked once per step, on every rank at the same step, whether to go on, snapshot
now, or stop. One object holds every decision a fault can change: the stop vote on signals (`StopVote`,
below; the signals are trainapp/faults/preempt.py's notices), the poll of the launcher's drain notices
(Ray's), and the snapshot cadence, so the training loop has one question to ask and no fault logic of
its own. A stop comes as a `Stop` that says everything the loop does with it: whether its snapshot is
announced, which record it leaves and which exception ends training; the loop reads no notice, signal or
launcher.
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

import torch
import torch.distributed as tdist

from trainapp.faults.preempt import Notices, Preempted, Resized, Stopped

if TYPE_CHECKING:
    from trainapp.group import DistContext

T = TypeVar("T")


class DrainNotices(Protocol):
    """Where a launcher's notices of a node going away come from (Ray Train's drains)."""

    def pending(self) -> bool:
        """A cheap local check: has this rank been told of a drain? (No collective.)"""

    def __call__(self) -> dict[str, Any] | None:
        """Every rank at once (it may be a barrier): a description of the drain under way, None when there
        is none; `new` is true the first time a drain is seen."""


@dataclass(frozen=True)
class Stop:
    """The agreed stop after this step, with a snapshot of it: a preemption notice (a signal), a stop the
    run's holder asked for (`by`: `ray job stop`, a driver's Ctrl-C), or a live resize of a Ray group."""

    signum: int
    kind: str
    """`preempted` (the launcher restarts the run), `stopped` (the run ends here, nobody restarts it) or
    `resized` (Ray Train replaces the group, which resumes from this snapshot): the record's kind."""
    by: str
    notices: Notices

    @property
    def announce(self) -> bool:
        """Whether the stop's snapshot is reported to Ray. A resize's is not: the controller waits for it
        and cannot take a report meanwhile; the next group finds it on storage."""
        return self.kind != "resized"

    def ending(self, step: int, snapshot: str, rank: int) -> tuple[dict[str, Any], Preempted]:
        """Once the snapshot is written: (the record's fields, the exception that ends training)."""
        seconds = self.notices.seconds_since()
        fields = {"step": step, "signal": signal.Signals(self.signum).name, "seconds": round(seconds, 3),
                  "phase": self.notices.phase_at_signal, "snapshot": snapshot,
                  **({"by": self.by} if self.by else {})}
        if self.kind == "resized":
            return fields, Resized(self.signum, step, seconds, snapshot, rank, self.by)
        if self.kind == "stopped":
            return fields, Stopped(self.signum, step, seconds, snapshot, rank, self.by)
        return fields, Preempted(self.signum, step, seconds, snapshot, rank)


@dataclass(frozen=True)
class Decision:
    stop: Stop | None = None
    """Stop after this step with a snapshot of it; None to go on."""
    snapshot: bool = False
    """Snapshot this step."""
    urgent: bool = False
    """The snapshot is a drain notice's: publish it at once."""


GO_ON = Decision()


class StepBoundary:
    """`decide(step, last)` at every step boundary on every rank. `due(step, last)`: the snapshot
    cadence (the snapshot manager's); `drains`: the launcher's drain notices, polled every `poll_s`
    (`preempt.ray_poll_s`) while some rank has one pending; `on_drain(step, notice)` hears of each
    drain seen (the run's records)."""

    def __init__(self, ctx: DistContext, notices: Notices, due: Callable[[int, bool], bool],
                 drains: DrainNotices | None = None, poll_s: float = 0.0,
                 on_drain: Callable[[int, dict[str, Any]], None] = lambda step, notice: None):
        self.ctx, self.notices, self.due, self.drains, self.on_drain = ctx, notices, due, drains, on_drain
        self.vote = StopVote(ctx, notices, poll_s if drains is not None else 0.0,
                             drains.pending if drains is not None else None)

    def decide(self, step: int, last: bool) -> Decision:
        signum = 0 if last else self.vote.stop(step)  # the last step ends the run anyway
        if signum:
            return Decision(stop=self._stop(signum))
        drained = self._drained(step)  # every rank enters the agreed poll, snapshot due or not
        if drained:
            return Decision(snapshot=True, urgent=True)
        return Decision(snapshot=True) if self.due(step, last) else GO_ON

    def _stop(self, signum: int) -> Stop:
        """Every rank, at the agreed step. Only rank 0 reads a stop the holder asked for (through the
        lease); the vote told the others a signal number only."""
        by, kind = self.ctx.broadcast_object((self.notices.stop_by, self.notices.stop_kind))
        return Stop(signum, "resized" if kind == "resize" else "stopped" if by else "preempted", by,
                    self.notices)

    def interrupts_eval(self) -> bool:
        """A notice has come: an evaluation under way stops short (the stop follows the next step)."""
        return bool(self.notices.signum)

    def _drained(self, step: int) -> bool:
        """True at every poll while a node of the run is being drained: snapshot now, keep training."""
        if self.drains is None:
            return False
        polled, notice = self.vote.take_poll(self.drains)
        if not polled:
            return False
        if notice is not None and notice.pop("new", True):
            self.on_drain(step, notice)
        return notice is not None

    def close(self) -> None:
        """Before the process group goes away: no vote may be in flight."""
        self.vote.close()


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
    last polled: `take_poll(ask)` then asks at the same boundary on every rank (the boundary where
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

    def take_poll(self, ask: Callable[[], T]) -> tuple[bool, T | None]:
        """At a boundary where the ranks agreed to poll (the same on every rank, once): (True, `ask()`),
        and the next poll's `poll_s` counts from when `ask` returned: a barrier slowed by a busy cluster
        is not training (CI once saw 0.31 s between polls 0.5 s apart when it counted). Else (False, None)."""
        if not self._poll:
            return False, None
        self._poll = False
        answer = ask()
        self.polled_t = time.perf_counter()
        return True, answer

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
