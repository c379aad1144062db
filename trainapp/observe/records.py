"""What a rank's run leaves on record: rank 0's metrics.jsonl records, its TensorBoard files and log
lines, and the straggler watch over every rank's timings. The loop (trainapp/core/loop.py) says what
happened; this module says how it is written down.

Records (trainapp/observe/metrics.py reads them): `start` (one per attempt: the world, the
placement and network of every rank, the start-up marks, the config), `train` (every
`train.log_every` steps), `ranks` and `straggler` (trainapp/observe/timings.py), `eval`, `snapshot`
and `snapshot_failed`, `drain_notice`, `preempted`, `stopped` (a stop the run's holder asked for:
`ray job stop`), `resized` (a live resize of a Ray worker group), `end`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from trainapp.config import Config
from trainapp.observe import goodput, logs, tboard, timings, tracking
from trainapp.observe.live import LiveMetrics
from trainapp.observe.metrics import METRICS, MetricsWriter, read, val_metrics

if TYPE_CHECKING:
    from trainapp.group import DistContext

log = logging.getLogger("trainapp.core.loop")  # the loop's lines, as the loop names them


# What the records read of the layers above (trainapp/core/build.py's Parts, trainapp/snapshots/manager.py's
# SnapshotManager), which this layer may not import.
class _Layout(Protocol):
    def micro_steps(self, rank: int | None = None) -> int: ...

    def to_dict(self) -> dict[str, Any]: ...


class Position(Protocol):
    """Where training is: trainapp/core/data.py's Progress (also what a snapshot's RNG state is saved at,
    trainapp/core/state.py)."""

    @property
    def global_step(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def epoch_sample(self) -> int: ...


class _Progress(Position, Protocol):
    @property
    def layout(self) -> _Layout: ...
    @property
    def global_batch(self) -> int: ...
    @property
    def resumed(self) -> dict[str, Any] | None: ...


class _Precision(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def why(self) -> str: ...


class _Parts(Protocol):
    @property
    def progress(self) -> _Progress: ...
    @property
    def precision(self) -> _Precision: ...
    @property
    def total_steps(self) -> int: ...
    @property
    def peak_lr(self) -> float: ...
    @property
    def kernels(self) -> dict[str, Any] | None: ...
    @property
    def parallel(self) -> dict[str, Any]: ...
    @property
    def resumed_from(self) -> str | None: ...
    @property
    def resumed_tier(self) -> str | None: ...
    @property
    def resumed_tiers(self) -> list[str] | None: ...
    @property
    def resumed_note(self) -> str | None: ...
    @property
    def config_changes(self) -> dict[str, list[Any]]: ...
    @property
    def init(self) -> dict[str, Any] | None: ...


class _Snapshots(Protocol):
    @property
    def failed(self) -> list[dict[str, Any]]: ...
    @property
    def failures(self) -> int: ...
    @property
    def async_write(self) -> bool: ...
    @property
    def last_blocking_s(self) -> float: ...
    @property
    def published_step(self) -> int | None: ...


class Records:
    """Rank 0 writes; the other ranks only log warnings. Made before the parts: a missing TensorBoard
    package is said before anything is built."""

    def __init__(self, cfg: Config, ctx: DistContext, fence: Callable[[str], None] | None = None,
                 lease: dict[str, Any] | None = None, live: LiveMetrics | None = None,
                 launcher: str = "alone") -> None:
        """`fence`: raises when the run's lease was taken over (before every record); `lease`: what the
        start record says of it; `live`: where this rank's live metrics go (trainapp/observe/live.py);
        `launcher`: what started the rank (torchrun, slurm, ray, alone), for the start record."""
        self.cfg, self.ctx, self.lease, self.live, self.launcher = cfg, ctx, lease, live, launcher
        if cfg.observe.tensorboard:
            tboard.check()
        tracking.check(cfg)
        self.trackers = tracking.senders(cfg, launcher, fence) if ctx.is_main else []
        self._ending = "FAILED"  # how the trackers' runs close unless a stop or the end says otherwise
        self.metrics = MetricsWriter(Path(cfg.run.dir) / METRICS if ctx.is_main else None, fence)
        self.board: tboard.Board | None = None
        self.stragglers = timings.Stragglers(cfg.observe.straggler_ratio, cfg.observe.straggler_intervals)
        self.hosts: list[str] = []  # by rank, from the start record's placement
        self.last_ranks: list[dict] | None = None
        self._started_at: float | None = None  # this attempt's start record; None after its first step

    def start(self, parts: _Parts, placement: dict[str, Any], restart: int | None,
              startup: dict[str, float]) -> None:
        """Every rank (it gathers each rank's network choice and placement on rank 0)."""
        ctx, p, cfg = self.ctx, parts.progress, self.cfg
        gathered = ctx.gather_objects((ctx.network.to_dict() if ctx.network else None, placement))
        network, placed = ([g[0] for g in gathered], [g[1] for g in gathered]) if gathered else (None, None)
        self.hosts = [pl["host"] for pl in placed or []]
        self.stragglers.work = [p.layout.micro_steps(r) for r in range(ctx.world_size)]
        resumed = p.resumed or {}
        # From where this attempt starts: one timeline across restarts.
        if cfg.observe.tensorboard and ctx.is_main:
            self.board = tboard.Board(cfg.run.dir, resumed.get("global_step"))
        self.metrics.write("start", step=p.global_step, epoch=p.epoch, epoch_sample=p.epoch_sample,
                           world_size=ctx.world_size, global_batch=p.global_batch, layout=p.layout.to_dict(),
                           total_steps=parts.total_steps, peak_lr=parts.peak_lr, amp=parts.precision.name,
                           amp_why=parts.precision.why, backend=ctx.backend, device=str(ctx.device),
                           device_why=ctx.device_why, kernels=parts.kernels, parallel=parts.parallel,
                           threads=torch.get_num_threads(), interop_threads=torch.get_num_interop_threads(),
                           restart=restart, resumed_from=parts.resumed_from,
                           resumed_step=resumed.get("global_step"), resumed_tier=parts.resumed_tier,
                           resumed_tiers=parts.resumed_tiers, resumed_note=parts.resumed_note,
                           resumed_world_size=resumed.get("world_size"), network=network, placement=placed,
                           startup=startup, lease=self.lease, config_changes=parts.config_changes,
                           init=parts.init, launcher=self.launcher, config=cfg.to_dict())
        for tracker in self.trackers:
            tracker.start()
        if self.live is not None:
            self.live.started(p.global_step, parts.total_steps, ctx.world_size)
            self._account_live()
        self._started_at = time.monotonic()
        log.info("config %s", json.dumps(cfg.to_dict(), separators=(",", ":")))
        log.info(_line(world_size=ctx.world_size, backend=ctx.backend, device=ctx.device,
                       amp=parts.precision.name, global_batch=p.global_batch, total_steps=parts.total_steps,
                       start_step=p.global_step))

    def after_step(self, step: int) -> None:
        """A step hook: after this attempt's first step, rank 0 says so, with how long it took (its first
        loss is checked, a compiled model compiled); nothing after."""
        if self._started_at is not None:
            log.info("%s: step %d, %.1f s after the start", logs.FIRST_STEP, step,
                     time.monotonic() - self._started_at)
            self._started_at = None

    def train(self, record: dict[str, Any]) -> None:
        self.metrics.write("train", **record)
        if self.live is not None:
            self.live.interval(record)
            self._account_live()
        if self.board is not None:
            keys = ("loss", "lr", "samples_per_s", "loss_scale", "skipped_steps")
            self.board.scalars("train", record["step"], {k: record.get(k) for k in keys})
        log.info(_line(**record))

    def ranks(self, step: int, rows: list[list[float]]) -> None:
        """Every rank: rank 0 writes the `ranks` record of this interval and any straggler it reveals; a
        rank serving live metrics runs the same straggler watch on the same rows for its node's ranks."""
        if not (self.ctx.is_main or self.live is not None):
            return
        self.last_ranks = timings.rank_rows(rows, self.hosts)
        self.metrics.write("ranks", step=step, ranks=self.last_ranks)
        if self.board is not None:
            self.board.ranks(step, self.last_ranks)
        for found in self.stragglers.update(step, self.last_ranks):
            self.metrics.write("straggler", **found)
            if self.ctx.is_main:
                log.warning("%s", timings.straggler_line(found, self.cfg.observe.straggler_ratio))
        if self.live is not None:
            self.live.rank_timings(self.last_ranks, self.stragglers.reported)

    def eval(self, epoch: int, result: dict[str, Any]) -> None:
        self.metrics.write("eval", epoch=epoch, **result)
        if self.board is not None:
            self.board.scalars("eval", result["step"], val_metrics(result))
        log.info(_line(**result))

    def snapshot(self, step: int, snapshots: _Snapshots) -> None:
        """After a snapshot (`snapshots`: the manager): rank 0's failures, taken from its list, then the
        snapshot itself unless it failed (a background write's outcome is known only later)."""
        self.snapshot_failures(snapshots.failed)
        if self.board is not None:
            self.board.flush()  # what a SIGKILL could lose is only ever steps after this snapshot
        if snapshots.failures == 0 or snapshots.async_write:
            self.metrics.write("snapshot", step=step, blocking_s=round(snapshots.last_blocking_s, 4),
                               background=snapshots.async_write)
            if self.live is not None:
                self.live.snapshot(step)
        for tracker in self.trackers:  # what the snapshot covers is final once it is published
            tracker.published = lambda: snapshots.published_step
            tracker.nudge()

    def snapshot_failures(self, failed: list[dict[str, Any]]) -> None:
        while failed:
            self.metrics.write("snapshot_failed", **failed.pop(0))

    def drain_notice(self, step: int, notice: dict[str, Any]) -> None:
        self.metrics.write("drain_notice", step=step, **notice)
        log.warning("preemption: %s; a snapshot now and about every %g s until the node is gone, training "
                    "goes on",
                    notice.get("what", "node drained"), self.cfg.preempt.ray_poll_s)

    def stop(self, kind: str, **fields: Any) -> None:
        """An agreed stop's record: `preempted`, `stopped` or `resized` (trainapp/faults/boundary.py's
        `Stop`). A stopped run's workers end normally, and its `end` record follows."""
        self.metrics.write(kind, **fields)
        self._ending = "KILLED"  # the next attempt (or resubmission) opens the trackers' runs again
        if kind != "stopped":
            self.metrics.close()

    def _account(self) -> dict[str, Any] | None:
        """Rank 0: the goodput account of the run so far, as if it ended now."""
        try:  # information: an account that cannot be made must not fail the run
            return goodput.account(read(self.cfg.run.dir, missing_ok=True)
                                   + [{"kind": "end", "time": time.time()}])
        except Exception as e:
            log.warning("no goodput account for %s: %s: %s", self.cfg.run.dir, e.__class__.__name__, e)
            return None

    def _account_live(self) -> None:
        assert self.live is not None  # its callers check
        if self.live.account_due():
            self.live.account(self._account())

    def end(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The `end` record: `summary` and, on rank 0, the account of the run's wall time over every
        attempt (trainapp/observe/goodput.py): `wall_s`, `goodput`, `badput_s`, `steps_redone`, which it
        returns for the done line."""
        added: dict[str, Any] = {}
        if self.ctx.is_main:
            acc = self._account()
            if self.live is not None:
                self.live.account(acc)
            if acc is not None:
                added = {"wall_s": round(acc["wall_s"], 3), "goodput": round(acc["goodput"], 4),
                         "badput_s": acc["badput_s"], "steps_redone": acc["steps_redone"]}
        self.metrics.write("end", **summary, **added)
        self.metrics.close()
        for tracker in self.trackers:
            tracker.finish("FINISHED", self.cfg.observe.tracking_wait_s, summary.get("model"))
        return added

    def close(self) -> None:
        for tracker in self.trackers:  # after `end` a no-op; else what this attempt published, briefly
            tracker.finish(self._ending, min(tracking.STOP_WAIT_S, self.cfg.observe.tracking_wait_s))
        if self.board is not None:
            self.board.close()
        self.metrics.close()
        if self.live is not None:
            self.live.close()
            self.live = None


def _line(**fields: Any) -> str:
    """A record as one `key=value` log line: floats rounded for reading, everything greppable."""
    def fmt(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    return " ".join(f"{k}={fmt(v)}" for k, v in fields.items())
