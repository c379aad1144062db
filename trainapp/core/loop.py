"""The training loop: DDP + autocast, gradient accumulation, distributed eval, rank-0 snapshots.

`run(cfg)` is the whole job on this process; `train(cfg, ctx)` is a rank's training under any launcher
(`run`'s, a Ray worker's), with its failures explained; `trainer(cfg, ctx)` builds the parts
(trainapp.core.build) and hands them to the `Trainer`, whose `train()` reads top to bottom. Neither knows who launched it:
alone, torchrun or a Ray Train worker all look the same from here (ranks in the environment, maybe a
process group already created).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm

from trainapp.faults import failure, heartbeat, preempt
from trainapp.launch import dist, malloc
from trainapp.observe import logs, tboard, timeline, timings
from trainapp.core.build import Parts, build
from trainapp.config import Config
from trainapp.core.data import make_loader, set_epoch
from trainapp.observe.metrics import METRICS, MetricsWriter, Throughput
from trainapp.observe.metrics import read as read_metrics
from trainapp.core.optim import scaled_lr
from trainapp.snapshots.snapshot import SnapshotManager, params_sha256

log = logging.getLogger(__name__)

# With fp16 the GradScaler skips the optimizer step on overflow; the schedule must still advance, and
# torch's "scheduler.step() before optimizer.step()" warning is a false alarm then.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")


class Trainer:
    """Trains the parts `build` made: steps, log records, evaluation, the fault drill, snapshots."""

    def __init__(self, cfg: Config, ctx: dist.DistContext, parts: Parts, snapshots: SnapshotManager,
                 drain_notice: Callable[[], dict | None] | None = None, attempt_no: int | None = None):
        self.cfg, self.ctx, self.parts, self.snapshots = cfg, ctx, parts, snapshots
        self.run_dir = Path(cfg.run.dir)
        self.vote = preempt.StopVote(ctx, cfg.preempt.ray_poll_s if drain_notice is not None else 0.0,
                                     getattr(drain_notice, "pending", None))
        self.watchdog = heartbeat.Watchdog(cfg.fault.hang_timeout_s, cfg.fault.hang_startup_s, self.run_dir, ctx.rank,
                                           attempt(self.run_dir) if attempt_no is None else attempt_no)
        f = cfg.fault
        self._drills = {at: name for name, at in (("kill", f.kill_at_step), ("hang", f.hang_at_step),
                                                  ("oom", f.oom_at_step)) if at is not None and f.rank == ctx.rank}
        """This rank's fault drills by step: one dict lookup per step, and none when no drill is set."""
        self.drain_notice = drain_notice
        """Asked about every `preempt.ray_poll_s` seconds, at the step boundary the ranks agreed on in
        the stop vote (a barrier under Ray), while its `pending()` (if it has one) is true on some rank:
        a dict describing a drain of one of the run's nodes while one is under way (`new` the first
        time), else None."""
        preempt.describe_snapshots(str(snapshots.root))
        self.metrics = MetricsWriter(self.run_dir / METRICS if ctx.is_main else None)
        self.last_loss, self.last_eval = float("nan"), None
        self._loss_sum = torch.zeros((), device=ctx.device)  # summed on the device, read at log time
        self._loss_steps = 0
        self.timer = timings.StepTimer(ctx.device, cfg.observe.ranks)
        if parts.ddp is not None and cfg.observe.ranks:
            self.timer.attach(parts.ddp)
        self.stragglers = timings.Stragglers(cfg.observe.straggler_ratio, cfg.observe.straggler_intervals)
        self.hosts: list[str] = []  # by rank, from the start record's placement
        self.last_ranks: list[dict] | None = None
        self._slow = (f.slow_phase, f.slow_ms / 1000) if f.slow_rank == ctx.rank else None
        """The slow-rank drill on this rank: (phase, seconds added to every step), else None."""
        resumed = (parts.progress.resumed or {}).get("global_step")
        self.board = tboard.Board(self.run_dir, resumed) if cfg.observe.tensorboard and ctx.is_main else None

    def train(self) -> dict[str, Any]:
        t, p, total = self.cfg.train, self.parts.progress, self.parts.total_steps
        start_step = p.global_step
        self._log_start()
        bar = tqdm(total=total, initial=p.global_step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (self.ctx.is_main and t.progress), mininterval=0.5)
        meter = Throughput(p.global_batch)
        self.parts.train_model.train()
        heartbeat.beat(p.global_step)  # the watchdog's startup allowance lasts until the step moves
        heartbeat.set_phase("step")
        self.watchdog.start()
        self.timer.restart()  # the first interval starts here, not at construction
        try:
            try:
                self._loop(bar, meter)
            finally:  # also when an error ends the run: no vote may be in flight when the group goes away
                bar.close()
                self.vote.close()
            return self._finish(start_step, meter.overall())
        finally:
            self.watchdog.stop()
            if self.board is not None:
                self.board.close()

    def _loop(self, bar: tqdm, meter: Throughput) -> None:
        t, p, total = self.cfg.train, self.parts.progress, self.parts.total_steps
        batches = None
        while p.global_step < total:
            self.timer.lap("other")
            if batches is None:
                batches = self._epoch_batches()
            self._loss_sum += self._run_step(batches)
            self._loss_steps += 1
            meter.step()
            if self._advance():
                batches = None  # the epoch is over: the next step starts the next one
            bar.update(1)
            heartbeat.beat(p.global_step)
            last = p.global_step == total
            signum = 0 if last else self.vote.stop(p.global_step)  # the last step ends the run anyway
            if signum:
                self._stop_preempted(signum, meter, bar)
            if p.global_step % t.log_every == 0 or last:
                self._log_train(meter.interval(), bar)
            if (t.eval_every and p.global_step % t.eval_every == 0) or last:
                with meter.paused(), heartbeat.phase("eval"), self._timed("eval"):
                    self.evaluate()
            self._maybe_fault()
            drained = self._drain_noticed()  # first: every rank enters the agreed poll, snapshot due or not
            if self.snapshots.due(p.global_step, last) or drained:
                with meter.paused(), heartbeat.phase("snapshot"), self._timed("snapshot"):
                    self._save(meter.overall(), final=last, urgent=drained)

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        self.timer.lap("other")
        try:
            yield
        finally:
            self.timer.lap(phase)

    # ------------------------------------------------------------------------------------------
    # Steps

    def _epoch_batches(self) -> Iterator:
        p = self.parts.progress
        set_epoch(self.parts.train_ds, self.parts.sampler, p.epoch, p.epoch_sample)
        loader = make_loader(self.parts.train_ds, self.parts.sampler, self.cfg.train.batch_size,
                             self.cfg.data.num_workers, self.ctx.device.type == "cuda",
                             self.cfg.seed * 100_003 + p.epoch)
        return iter(loader)

    def _run_step(self, batches: Iterator) -> torch.Tensor:
        parts, accum = self.parts, self.cfg.train.grad_accum
        scaler = parts.precision.scaler
        loss_sum = torch.zeros((), device=self.ctx.device)
        for micro in range(accum):
            heartbeat.set_phase("data")
            x, y = self._to_device(*next(batches))
            self._drill_slow("data")
            self.timer.lap("data")
            heartbeat.set_phase("step")
            # All-reduce only on the last micro-step; the others just accumulate local gradients.
            sync = parts.ddp is None or micro == accum - 1
            with contextlib.nullcontext() if sync else parts.ddp.no_sync():
                with parts.precision.autocast():
                    loss = F.cross_entropy(parts.train_model(x), y)
                self._drill_slow("compute")  # between forward and backward, as a slow device would be
                scaler.scale(loss / accum).backward()
            self.timer.lap_backward()
            loss_sum += loss.detach()
        if self.cfg.train.grad_clip > 0:
            scaler.unscale_(parts.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(parts.model.parameters(), self.cfg.train.grad_clip)
        scale = parts.precision.scale_tensor()
        before = scale.clone() if scale is not None else None
        scaler.step(parts.optimizer)  # skipped by the scaler when fp16 gradients hold inf/NaN
        scaler.update()
        if before is not None:
            parts.progress.skipped += (parts.precision.scale_tensor() < before).to(torch.int64)
        parts.optimizer.zero_grad(set_to_none=True)
        parts.scheduler.step()
        if parts.ema is not None:
            parts.ema.update_parameters(parts.model)
        self._drill_slow("optim")
        self.timer.lap("optim")
        self.timer.step_done()
        return loss_sum / accum

    def _drill_slow(self, phase: str) -> None:
        if self._slow is not None and self._slow[0] == phase:
            time.sleep(self._slow[1])

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)
        if self.cfg.model.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def _advance(self) -> bool:
        """Count the step just taken; True when it was the epoch's last (the sampler says when)."""
        p = self.parts.progress
        p.global_step += 1
        p.epoch_sample += p.global_batch
        if self.parts.sampler.steps_from(p.epoch_sample) == 0:
            p.epoch, p.epoch_sample = p.epoch + 1, 0
            return True
        return False

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Accuracy over the whole validation set: correct/total summed across ranks."""
        parts = self.parts
        model = parts.ema.module if parts.ema is not None else parts.model
        was_training = model.training
        model.eval()
        # correct, total, loss sum, ranks that stopped early for a preemption notice
        stats = torch.zeros(4, dtype=torch.float64, device=self.ctx.device)
        for batch in parts.val_loader:
            # The stop comes after the next step, so a partial eval is not recorded. The last step's eval
            # runs to the end: no stop follows it, the run ends normally.
            if preempt.received() and parts.progress.global_step < parts.total_steps:
                stats[3] = 1
                break
            heartbeat.beat()
            x, y = self._to_device(*batch)
            with parts.precision.autocast():
                out = model(x)
            stats[0] += (out.argmax(1) == y).sum()
            stats[1] += y.numel()
            stats[2] += F.cross_entropy(out.float(), y, reduction="sum")
        model.train(was_training)
        correct, total, loss, interrupted = dist.all_reduce_sum(self.ctx, stats).tolist()
        if interrupted:
            log.warning("eval at step %d cut short by a preemption notice; not recorded", parts.progress.global_step)
            return self.last_eval
        self.last_eval = {"step": parts.progress.global_step, "val_acc": correct / max(total, 1),
                          "val_loss": loss / max(total, 1), "val_samples": int(total)}
        self.metrics.write("eval", epoch=parts.progress.epoch, **self.last_eval)
        if self.board is not None:
            self.board.scalars("eval", self.last_eval["step"], {k: self.last_eval[k] for k in ("val_acc", "val_loss")})
        log.info(logs.kv(**self.last_eval))
        return self.last_eval

    def _maybe_fault(self) -> None:
        if not self._drills:
            return
        f, step = self.cfg.fault, self.parts.progress.global_step
        what = self._drills.get(step)
        if what is None:
            return
        marker = self.run_dir / f"fault-fired-{'' if what == 'kill' else what + '-'}step{step}-rank{f.rank}"
        if marker.exists():  # fired before this restart
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        with open(marker, "w") as fh:
            fh.write(f"{time.time()}\n")
            fh.flush()
            os.fsync(fh.fileno())
        if what == "hang":
            log.warning("fault drill: rank %d stops making progress after step %d (a stuck data loader)", f.rank, step)
            heartbeat.set_phase("data")
            while True:
                time.sleep(3600)
        if what == "oom":
            heartbeat.set_phase("step")
            raise torch.OutOfMemoryError(f"fault drill (fault.oom_at_step={step}): rank {f.rank} ran out of memory "
                                         f"on {self.ctx.device}")
        log.warning("fault drill: rank %d kills itself with SIGKILL at step %d", f.rank, step)
        self.metrics.close()
        os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------------------------------------
    # Records and snapshots

    def _log_start(self) -> None:
        ctx, p, cfg = self.ctx, self.parts.progress, self.cfg
        gathered = dist.gather_objects(ctx, (ctx.network.to_dict() if ctx.network else None, dist.placement(ctx)))
        network, placement = ([g[0] for g in gathered], [g[1] for g in gathered]) if gathered else (None, None)
        self.hosts = [pl["host"] for pl in placement or []]
        resumed = p.resumed or {}
        self.metrics.write("start", step=p.global_step, epoch=p.epoch, epoch_sample=p.epoch_sample,
                           world_size=ctx.world_size, global_batch=p.global_batch, total_steps=self.parts.total_steps,
                           peak_lr=scaled_lr(cfg.optim, p.global_batch), amp=self.parts.precision.name,
                           backend=ctx.backend, device=str(ctx.device), threads=torch.get_num_threads(),
                           interop_threads=torch.get_num_interop_threads(),
                           restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                           resumed_from=self.parts.resumed_from, resumed_step=resumed.get("global_step"),
                           resumed_world_size=resumed.get("world_size"), network=network, placement=placement,
                           startup=timeline.marks(), config=cfg.to_dict())
        log.info("config %s", json.dumps(cfg.to_dict(), separators=(",", ":")))
        log.info(logs.kv(world_size=ctx.world_size, backend=ctx.backend, device=ctx.device,
                         amp=self.parts.precision.name, global_batch=p.global_batch,
                         total_steps=self.parts.total_steps, start_step=p.global_step))

    def _log_train(self, samples_per_s: float, bar: tqdm) -> None:
        # The only host syncs of the loop: once per log interval. One all-gather carries every rank's
        # phase timings and loss sums.
        p, precision, ctx = self.parts.progress, self.parts.precision, self.ctx
        row = torch.cat([torch.tensor(self.timer.collect(), dtype=torch.float64, device=ctx.device),
                         torch.stack([self._loss_sum.double(),
                                      torch.tensor(float(self._loss_steps), dtype=torch.float64, device=ctx.device)])])
        rows = dist.all_gather(ctx, row).cpu()
        self.last_loss = (rows[:, -2].sum() / rows[:, -1].sum()).item()
        if self.timer.enabled and ctx.is_main:
            self._log_ranks(rows[:, :-2].tolist())
        record = {"step": p.global_step, "epoch": p.epoch, "loss": self.last_loss, "lr": self._current_lr(),
                  "samples_per_s": samples_per_s, "world_size": self.ctx.world_size, "epoch_sample": p.epoch_sample,
                  "skipped_steps": int(p.skipped.item())}
        if precision.scaler.is_enabled():
            record["loss_scale"] = float(precision.scale_tensor().item())
        self.metrics.write("train", **record)
        if self.board is not None:
            self.board.scalars("train", p.global_step, {k: record.get(k) for k in
                                                        ("loss", "lr", "samples_per_s", "loss_scale", "skipped_steps")})
        log.info(logs.kv(**record))
        bar.set_postfix(loss=f"{self.last_loss:.3f}", lr=f"{record['lr']:.3g}")
        self._loss_sum.zero_()
        self._loss_steps = 0

    def _log_ranks(self, rows: list[list[float]]) -> None:
        """Rank 0: the `ranks` record of this interval, and any straggler it reveals."""
        step = self.parts.progress.global_step
        self.last_ranks = timings.rank_rows(rows, self.hosts)
        self.metrics.write("ranks", step=step, ranks=self.last_ranks)
        if self.board is not None:
            self.board.ranks(step, self.last_ranks)
        for found in self.stragglers.update(step, self.last_ranks):
            self.metrics.write("straggler", **found)
            log.warning("%s", timings.straggler_line(found, self.cfg.observe.straggler_ratio))

    def _current_lr(self) -> float:
        groups = self.parts.optimizer.param_groups
        return next((g["lr"] for g in groups if g["lr_mult"] == 1.0), groups[0]["lr"])

    def _save(self, samples_per_s: float, final: bool = False, urgent: bool = False) -> None:
        p = self.parts.progress
        state = self.parts.state.state_dict(self.ctx.is_main)  # every rank: the RNG part gathers all ranks'
        meta = {**state["progress"], "params_sha256": params_sha256(self.parts.model)} if state is not None else None
        report = {"step": p.global_step, "epoch": p.epoch, "loss": self.last_loss, "world_size": self.ctx.world_size,
                  "samples_per_s": samples_per_s}
        if self.last_eval is not None and self.last_eval["step"] == p.global_step:
            report["val_acc"] = self.last_eval["val_acc"]
        if self.last_ranks:  # under Ray these go with ray.train.report
            report["ranks"] = [{k: r[k] for k in ("rank", "host", "step_ms", "busy_ms")} for r in self.last_ranks]
        try:
            self.snapshots.save(self.ctx, p.global_step, state, meta, report, final=final, urgent=urgent)
        finally:
            self._record_snapshot_failures()
            if self.board is not None:
                self.board.flush()  # what a SIGKILL could lose is only ever steps after this snapshot
        if self.snapshots.failures == 0 or self.snapshots.async_write:
            self.metrics.write("snapshot", step=p.global_step, blocking_s=round(self.snapshots.last_blocking_s, 4),
                               background=self.snapshots.async_write)

    def _record_snapshot_failures(self) -> None:
        while self.snapshots.failed:
            self.metrics.write("snapshot_failed", **self.snapshots.failed.pop(0))

    def _finish_snapshots(self) -> None:
        try:
            self.snapshots.finish(self.ctx)
        finally:
            self._record_snapshot_failures()

    def _drain_noticed(self) -> bool:
        """True at every poll while a node of the run is being drained: snapshot now, keep training."""
        if self.drain_notice is None or not self.vote.take_poll():
            return False
        notice = self.drain_notice()
        if notice is not None and notice.pop("new", True):
            self.metrics.write("drain_notice", step=self.parts.progress.global_step, **notice)
            log.warning("preemption: %s; a snapshot now and about every %g s until the node is gone, training goes on",
                        notice.get("what", "node drained"), self.cfg.preempt.ray_poll_s)
        return notice is not None

    def _stop_preempted(self, signum: int, meter: Throughput, bar: tqdm) -> None:
        """Every rank, at the agreed step: the snapshot of this step (after any write in flight), a
        `preempted` record, then `Preempted` out of train()."""
        p = self.parts.progress
        bar.close()
        with meter.paused(), heartbeat.phase("snapshot"):
            self._save(meter.overall(), final=True)
            self._finish_snapshots()
        self.vote.close()
        seconds = preempt.seconds_since()
        self.metrics.write("preempted", step=p.global_step, signal=signal.Signals(signum).name, seconds=round(seconds, 3),
                           phase=preempt.phase_at_signal(), snapshot=str(self.snapshots.path_for(p.global_step)))
        self.metrics.close()
        raise preempt.Preempted(signum, p.global_step, seconds, str(self.snapshots.path_for(p.global_step)),
                                self.ctx.rank)

    def _finish(self, start_step: int, samples_per_s: float) -> dict[str, Any]:
        p = self.parts.progress
        if self.last_eval is None or self.last_eval["step"] != p.global_step:
            self.evaluate()
        summary = {"steps": p.global_step, "steps_this_run": p.global_step - start_step, "final_loss": self.last_loss,
                   "val_acc": self.last_eval["val_acc"], "world_size": self.ctx.world_size,
                   "samples_per_s": samples_per_s, "skipped_steps": int(p.skipped.item()),
                   "snapshots": str(self.snapshots.root)}
        self._finish_snapshots()  # the final snapshot is on disk before the run says it ended
        self.metrics.write("end", **summary)
        self.metrics.close()
        return summary


def attempt(run_dir: Path) -> int:
    """Which attempt at the run this is, counted from 0 by the `start` records before it (rank 0 writes
    one per attempt, once every rank has read this): the same under every launcher and across
    resubmissions, for the watchdog's file names and the failure records."""
    return len(read_metrics(run_dir, "start", missing_ok=True))


def trainer(cfg: Config, ctx: dist.DistContext, snapshots: SnapshotManager | None = None,
            drain_notice: Callable[[], dict | None] | None = None, attempt_no: int | None = None) -> Trainer:
    """The parts of a run, resumed from its newest valid snapshot, and the Trainer over them."""
    malloc.keep_freed_memory()  # before the parts and the first step allocate what every step reuses
    snapshots = snapshots or SnapshotManager.from_config(cfg)
    return Trainer(cfg, ctx, build(cfg, ctx, snapshots), snapshots, drain_notice, attempt_no)


def train(cfg: Config, ctx: dist.DistContext, snapshots: SnapshotManager | None = None,
          drain_notice: Callable[[], dict | None] | None = None) -> dict[str, Any]:
    """This rank's whole training under any launcher: build, resume and train, with whatever ends it
    explained and its peers' failures watched for (trainapp/faults/failure.py)."""
    attempt_no = attempt(Path(cfg.run.dir))
    with failure.watching(cfg.run.dir, ctx, attempt_no):
        return trainer(cfg, ctx, snapshots, drain_notice, attempt_no).train()


def run(cfg: Config) -> dict[str, Any]:
    """The whole job on this process: set up distributed, train, evaluate, tear down what we created."""
    timeline.mark_process("worker_process")
    logs.setup_from_env()  # the network check logs before the group exists
    preempt.install(cfg.preempt.signals, cfg.preempt.grace_s)
    entry = preempt.register()
    try:
        ctx = dist.setup(cfg.dist.timeout_s, cfg.network)
        timeline.mark("process_group")
        logs.setup(ctx.rank, ctx.world_size)
        try:
            summary = train(cfg, ctx)
        finally:
            dist.teardown(ctx)
    finally:
        preempt.unregister(entry)
    return {**summary, "rank": ctx.rank}
