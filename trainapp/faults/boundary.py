"""The step boundary: asked once per step, on every rank at the same step, whether to go on, snapshot
now, or stop. One object holds every decision a fault can change: the stop vote on signals
(trainapp/faults/preempt.py), the poll of the launcher's drain notices (Ray's), and the snapshot
cadence, so the training loop has one question to ask and no fault logic of its own. A stop comes as
a `Stop` that says everything the loop does with it: whether its snapshot is announced, which record
it leaves and which exception ends training; the loop reads no notice, signal or launcher.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from trainapp.faults.preempt import Notices, Preempted, Resized, Stopped, StopVote

if TYPE_CHECKING:
    from trainapp.group import DistContext


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
        if self.drains is None or not self.vote.take_poll():
            return False
        notice = self.drains()
        if notice is not None and notice.pop("new", True):
            self.on_drain(step, notice)
        return notice is not None

    def close(self) -> None:
        """Before the process group goes away: no vote may be in flight."""
        self.vote.close()
