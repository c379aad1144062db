"""The rank's guard: one object per process that owns everything watching the rank on the run's behalf.

It holds the heartbeat and the hang watchdog (trainapp/faults/heartbeat.py), the preemption notices
with their signal handlers and grace deadline (trainapp/faults/preempt.py), the failure record and
the peer watch (trainapp/faults/failure.py), and the start-up timeline. Every watcher thread is
started here, and each one that must end the process (a hang, a failed peer, a grace period run out,
a notice before the first step) does so through the failure log and `trainapp.errors.leave`.

A launcher makes the guard before anything else in the process (`install` from the main thread,
where Python takes signals). Under Ray that is the worker's set-up, before the process group, and
the training function runs later in another thread: it finds the same guard again with
`RankGuard.installed()`, through the process's signal table, which is process-wide state anyway.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from trainapp import errors
from trainapp.config import FaultSection
from trainapp.errors import HUNG_EXIT
from trainapp.faults.failure import FailureLog
from trainapp.faults.heartbeat import Heartbeat, Watchdog
from trainapp.faults.preempt import Notices
from trainapp.observe import metrics
from trainapp.observe.timeline import Timeline
from trainapp.startup import GcPause

if TYPE_CHECKING:
    from types import FrameType

    from trainapp.group import DistContext


class RankGuard:
    """The heartbeat, the notices and the failure log of this process, and the watchdog of its run."""

    def __init__(self, leave: Callable[[int], None] = errors.leave) -> None:
        self.heartbeat = Heartbeat()
        self.failures = FailureLog(self.heartbeat, leave)
        self.notices = Notices(self.heartbeat, self.failures.end)
        self.timeline = Timeline()
        self.watchdog: Watchdog | None = None
        self.before_training: threading.Thread | None = None
        """Work the launcher started before training that training must wait for (Ray: imports made
        while the process group forms)."""
        self.gc_pause: GcPause | None = None
        """The collector paused for the process's start-up (trainapp/startup.py), ended once the parts
        are built."""

    def install(self, signals: list[str], grace_s: float) -> bool:
        """Handle SIGTERM, SIGINT and `signals` as preemption notices in this process (from its main
        thread), with `grace_s` to stop in (`preempt.*`); False where impossible."""
        return self.notices.install(signals, grace_s, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.notices.handle(signum)

    @staticmethod
    def installed() -> RankGuard | None:
        """The guard whose handler this process runs for SIGTERM (a launcher installed it earlier)."""
        owner = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        return owner if isinstance(owner, RankGuard) else None

    @contextlib.contextmanager
    def watching(self, run_dir: Path, fault: FaultSection, ctx: DistContext,
                 store: Callable[[], Any]) -> Iterator[None]:
        """A rank's run in `run_dir` (`fault`: the hang watchdog's settings): what ends it is recorded
        (trainapp/faults/failure.py), peers' failures are watched
        for through the store `store()` opens (the group's, None alone), and the hang watchdog is ready
        to `start_watchdog`. The attempt is numbered by the attempts that started before it (their
        `start` records), for its failure records and its hang report's name.
        Leave the block before the process group goes away: rank 0 may host the store."""
        attempt = len(metrics.read(run_dir, "start", missing_ok=True))
        self.watchdog = Watchdog(self.heartbeat, fault.hang_timeout_s, fault.hang_startup_s,
                                 run_dir / "hangs" / f"rank-{ctx.rank}-attempt-{attempt}.txt", ctx.rank,
                                 self._hung)
        try:
            with self.failures.watching(run_dir, ctx, store, attempt):
                yield
        finally:
            self.watchdog.stop()

    def start_watchdog(self, step: int) -> None:
        """Training starts at `step`: the watchdog's start-up allowance lasts until the step moves."""
        self.heartbeat.beat(step)
        if self.watchdog is not None:
            self.watchdog.start()

    def _hung(self, silent: float) -> None:
        assert self.watchdog is not None  # it calls this
        error = (f"no progress for {silent:.0f} s (fault.hang_timeout_s={self.watchdog.timeout_s:g}); "
                 f"stacks in {self.watchdog.path}; the launcher restarts the group from the newest snapshot")
        error += self.watchdog.dump_stacks(self.failures.line_for("hang", error, HUNG_EXIT))
        self.failures.end("hang", error, HUNG_EXIT, silent_s=round(silent, 1))

    def training_over(self) -> None:
        """Training in this process is over: signals are no longer notices (trainapp/faults/preempt.py)."""
        self.notices.training_over()
