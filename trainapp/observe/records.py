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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from trainapp.config import ObserveSection
from trainapp.observe import goodput, logs, tboard, timings, tracking
from trainapp.observe.live import LiveMetrics
from trainapp.observe.metrics import METRICS, MetricsWriter, read, val_metrics

if TYPE_CHECKING:
    from trainapp.group import DistContext

log = logging.getLogger("trainapp.core.loop")  # the loop's lines, as the loop names them


@dataclass
class StartFacts:
    """What an attempt's `start` record says of the run's parts (made by trainapp/core/build.py's
    `Parts.start_facts`): plain values, so that this layer reads nothing of the layers above."""

    step: int
    epoch: int
    epoch_sample: int
    global_batch: int
    layout: dict[str, Any]
    """The layout of a global batch over the ranks (trainapp/core/layout.py's `to_dict`)."""
    micro_steps: list[int]
    """Micro-batches each rank trains per step, by rank: the work the straggler watch weighs."""
    total_steps: int
    peak_lr: float
    amp: str
    amp_why: str
    kernels: dict[str, Any] | None
    parallel: dict[str, Any]
    resumed: dict[str, Any] | None
    """The resumed snapshot's position (`global_step`, `world_size`), None for a fresh start."""
    resumed_from: str | None
    resumed_tier: str | None
    resumed_tiers: list[str] | None
    resumed_note: str | None
    config_changes: dict[str, list[Any]]
    init: dict[str, Any] | None


class Records:
    """Rank 0 writes; the other ranks only log warnings. Made before the parts: a missing TensorBoard
    package is said before anything is built."""

    def __init__(self, ctx: DistContext, observe: ObserveSection, run_dir: str | Path,
                 config: dict[str, Any] | None = None, *, fence: Callable[[str], None] | None = None,
                 lease: dict[str, Any] | None = None, live: LiveMetrics | None = None,
                 launcher: str = "alone") -> None:
        """`observe`: the run's `observe` section; `run_dir`: where metrics.jsonl goes; `config`: the
        run's whole config as a dict, for the start record and the log; `fence`: raises when the run's
        lease was taken over (before every record); `lease`: what the start record says of it; `live`:
        where this rank's live metrics go (trainapp/observe/live.py); `launcher`: what started the rank
        (torchrun, slurm, ray, alone), for the start record."""
        self.ctx, self.observe, self.run_dir, self.config = ctx, observe, Path(run_dir), config or {}
        self.lease, self.live, self.launcher = lease, live, launcher
        if observe.tensorboard:
            tboard.check()
        tracking.check(observe)
        self.trackers = tracking.senders(observe, self.run_dir, launcher, fence) if ctx.is_main else []
        self._ending = "FAILED"  # how the trackers' runs close unless a stop or the end says otherwise
        self.metrics = MetricsWriter(self.run_dir / METRICS if ctx.is_main else None, fence)
        self.board: tboard.Board | None = None
        self.stragglers = timings.Stragglers(observe.straggler_ratio, observe.straggler_intervals)
        self.hosts: list[str] = []  # by rank, from the start record's placement
        self.last_ranks: list[dict] | None = None
        self._started_at: float | None = None  # this attempt's start record; None after its first step

    def start(self, p: StartFacts, placement: dict[str, Any], restart: int | None,
              startup: dict[str, float]) -> None:
        """Every rank (it gathers each rank's network choice and placement on rank 0)."""
        ctx = self.ctx
        gathered = ctx.gather_objects((ctx.network.to_dict() if ctx.network else None, placement))
        network, placed = ([g[0] for g in gathered], [g[1] for g in gathered]) if gathered else (None, None)
        self.hosts = [pl["host"] for pl in placed or []]
        self.stragglers.work = p.micro_steps
        resumed = p.resumed or {}
        # From where this attempt starts: one timeline across restarts.
        if self.observe.tensorboard and ctx.is_main:
            self.board = tboard.Board(str(self.run_dir), resumed.get("global_step"))
        self.metrics.write("start", step=p.step, epoch=p.epoch, epoch_sample=p.epoch_sample,
                           world_size=ctx.world_size, global_batch=p.global_batch, layout=p.layout,
                           total_steps=p.total_steps, peak_lr=p.peak_lr, amp=p.amp, amp_why=p.amp_why,
                           backend=ctx.backend, device=str(ctx.device), device_why=ctx.device_why,
                           kernels=p.kernels, parallel=p.parallel, threads=torch.get_num_threads(),
                           interop_threads=torch.get_num_interop_threads(), restart=restart,
                           resumed_from=p.resumed_from, resumed_step=resumed.get("global_step"),
                           resumed_tier=p.resumed_tier, resumed_tiers=p.resumed_tiers,
                           resumed_note=p.resumed_note, resumed_world_size=resumed.get("world_size"),
                           network=network, placement=placed, startup=startup, lease=self.lease,
                           config_changes=p.config_changes, init=p.init, launcher=self.launcher,
                           config=self.config)
        for tracker in self.trackers:
            tracker.start()
        if self.live is not None:
            self.live.started(p.step, p.total_steps, ctx.world_size)
            self._account_live()
        self._started_at = time.monotonic()
        log.info("config %s", json.dumps(self.config, separators=(",", ":")))
        log.info(_line(world_size=ctx.world_size, backend=ctx.backend, device=ctx.device, amp=p.amp,
                       global_batch=p.global_batch, total_steps=p.total_steps, start_step=p.step))

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
                log.warning("%s", timings.straggler_line(found, self.observe.straggler_ratio))
        if self.live is not None:
            self.live.rank_timings(self.last_ranks, self.stragglers.reported)

    def eval(self, epoch: int, result: dict[str, Any]) -> None:
        self.metrics.write("eval", epoch=epoch, **result)
        if self.board is not None:
            self.board.scalars("eval", result["step"], val_metrics(result))
        log.info(_line(**result))

    def snapshot(self, step: int, *, failed: list[dict[str, Any]], failures: int, background: bool,
                 blocking_s: float, published: Callable[[], int | None]) -> None:
        """After a snapshot: rank 0's failures, taken from the manager's list `failed`, then the snapshot
        itself unless it failed (`failures`: the manager's count; a `background` write's outcome is known
        only later); `blocking_s`: what it held the step for; `published()`: the newest published step."""
        self.snapshot_failures(failed)
        if self.board is not None:
            self.board.flush()  # what a SIGKILL could lose is only ever steps after this snapshot
        if failures == 0 or background:
            self.metrics.write("snapshot", step=step, blocking_s=round(blocking_s, 4), background=background)
            if self.live is not None:
                self.live.snapshot(step)
        for tracker in self.trackers:  # what the snapshot covers is final once it is published
            tracker.published = published
            tracker.nudge()

    def snapshot_failures(self, failed: list[dict[str, Any]]) -> None:
        while failed:
            self.metrics.write("snapshot_failed", **failed.pop(0))

    def drain_notice(self, step: int, notice: dict[str, Any], every_s: float = 0.0) -> None:
        """A node drain heard at `step`; snapshots follow about every `every_s` (`preempt.ray_poll_s`)."""
        self.metrics.write("drain_notice", step=step, **notice)
        log.warning("preemption: %s; a snapshot now and about every %g s until the node is gone, training "
                    "goes on", notice.get("what", "node drained"), every_s)

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
            return goodput.account(read(self.run_dir, missing_ok=True)
                                   + [{"kind": "end", "time": time.time()}])
        except Exception as e:
            log.warning("no goodput account for %s: %s: %s", self.run_dir, e.__class__.__name__, e)
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
            tracker.finish("FINISHED", self.observe.tracking_wait_s, summary.get("model"))
        return added

    def close(self) -> None:
        for tracker in self.trackers:  # after `end` a no-op; else what this attempt published, briefly
            tracker.finish(self._ending, min(tracking.STOP_WAIT_S, self.observe.tracking_wait_s))
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
