"""The step boundary: asked once per step, on every rank at the same step, whether to go on, snapshot
now, or stop. One object holds every decision a fault can change: the stop vote on signals
(trainapp/faults/preempt.py), the poll of the launcher's drain notices (Ray's), and the snapshot
cadence, so the training loop has one question to ask and no fault logic of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from trainapp.faults.preempt import Notices, StopVote


class DrainNotices(Protocol):
    """Where a launcher's notices of a node going away come from (Ray Train's drains)."""

    def pending(self) -> bool:
        """A cheap local check: has this rank been told of a drain? (No collective.)"""

    def __call__(self) -> dict[str, Any] | None:
        """Every rank at once (it may be a barrier): a description of the drain under way, None when there
        is none; `new` is true the first time a drain is seen."""


@dataclass(frozen=True)
class Decision:
    stop: int = 0
    """The agreed signal number: stop after this step with a snapshot of it; 0 to go on."""
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

    def __init__(self, ctx, notices: Notices, due: Callable[[int, bool], bool], drains: DrainNotices | None = None,
                 poll_s: float = 0.0, on_drain: Callable[[int, dict[str, Any]], None] = lambda step, notice: None):
        self.due, self.drains, self.on_drain = due, drains, on_drain
        self.vote = StopVote(ctx, notices, poll_s if drains is not None else 0.0,
                             drains.pending if drains is not None else None)

    def decide(self, step: int, last: bool) -> Decision:
        signum = 0 if last else self.vote.stop(step)  # the last step ends the run anyway
        if signum:
            return Decision(stop=signum)
        drained = self._drained(step)  # every rank enters the agreed poll, snapshot due or not
        if drained:
            return Decision(snapshot=True, urgent=True)
        return Decision(snapshot=True) if self.due(step, last) else GO_ON

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
