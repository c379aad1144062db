"""The training loop: data parallel + autocast, gradient accumulation, distributed eval, snapshots. What is
trained, on what data, with which loss, is the task's (trainapp/core/task.py): the loop calls its
`loss` and `evaluate` and knows nothing else about it.

`Trainer.train()` reads top to bottom: a step, then the step boundary's one answer (go on, snapshot,
or stop: trainapp/faults/boundary.py), the log interval, evaluation and the step hooks (the drills).
It trains the parts `build` made (trainapp/core/build.py) and neither knows nor asks which launcher
started the process: the launcher seam (trainapp/launch/rank.py) hands it everything it needs.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from tqdm import tqdm

from trainapp.config import TrainSection
from trainapp.core import parallel
from trainapp.core.build import Parts
from trainapp.core.final import export_final
from trainapp.core.layout import seed_slot
from trainapp.faults.boundary import Stop, StepBoundary
from trainapp.faults.guard import RankGuard
from trainapp.group import DistContext
from trainapp.observe.metrics import Throughput, val_metrics
from trainapp.observe.records import Records
from trainapp.observe.timings import PhaseClock
from trainapp.snapshots.manager import SnapshotManager, SnapshotRequest

log = logging.getLogger(__name__)

# With fp16 the GradScaler skips the optimizer step on overflow; the schedule must still advance, and
# torch's "scheduler.step() before optimizer.step()" warning is a false alarm then.
warnings.filterwarnings("ignore",
                        message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")


@dataclass(frozen=True)
class LoopSettings:
    """What the loop reads of the run's config, given by the assembler (trainapp/launch/rank.py)."""

    train: TrainSection
    """The `train` section: steps, epochs, evaluation and logging cadence, clipping, the global batch."""
    seed: int
    """The run's `seed`: each micro-batch's slot is seeded from it and the step."""
    run_dir: str
    """`run.dir`: where the final model goes (`run_dir`/model)."""
    time_ranks: bool = True
    """`observe.ranks`: time each rank's phases (the `ranks` records, stragglers)."""
    export: bool = True
    """`run.export`: write the final model when training ends."""


class Trainer:
    """Trains `parts` to `parts.total_steps`. `guard` (trainapp/faults/guard.py) watches the rank,
    `boundary` decides at each step boundary, `snapshots` writes them, `records` writes down what
    happened, and each of `step_hooks` is called with the step number after every step; `settings`: what
    it reads of the config."""

    def __init__(self, ctx: DistContext, parts: Parts, snapshots: SnapshotManager, guard: RankGuard,
                 boundary: StepBoundary, records: Records, settings: LoopSettings,
                 step_hooks: tuple[Callable[[int], None], ...] = ()):
        self.ctx, self.parts, self.snapshots, self.settings = ctx, parts, snapshots, settings
        self.guard, self.boundary, self.records, self.step_hooks = guard, boundary, records, step_hooks
        self.last_loss = float("nan")
        self.last_eval: dict[str, Any] | None = None
        self._loss_sum = torch.zeros((), device=ctx.device)  # summed on the device, read at log time
        self._loss_steps = 0
        self.clock = PhaseClock(ctx.device, settings.time_ranks, guard.heartbeat.set_phase)
        if settings.time_ranks:
            parts.strategy.time_waits(self.clock)

    def train(self) -> dict[str, Any]:
        t, p = self.settings.train, self.parts.progress
        start_step = p.global_step
        bar = tqdm(total=self.parts.total_steps, initial=p.global_step, desc="train", unit="step",
                   dynamic_ncols=True, disable=not (self.ctx.is_main and t.progress), mininterval=0.5)
        meter = Throughput(p.global_batch)
        self.parts.train_model.train()
        self.guard.start_watchdog(p.global_step)
        self.clock.restart()  # the first interval starts here, not at construction
        try:
            try:
                self._loop(bar, meter)
            finally:  # also when an error ends the run: no vote may be in flight when the group goes away
                bar.close()
                self.boundary.close()
            return self._finish(start_step, meter.overall())
        finally:
            self.records.close()

    def _loop(self, bar: tqdm, meter: Throughput) -> None:
        t, p, total = self.settings.train, self.parts.progress, self.parts.total_steps
        batches = None
        while p.global_step < total and p.epoch < t.epochs:  # a stream may run out before `total`
            batches = self._counted_step(batches, meter, bar)
            last = p.global_step == total or p.epoch == t.epochs
            decision = self.boundary.decide(p.global_step, last)
            if decision.stop:
                self._stop(decision.stop, meter, bar)
            if p.global_step % t.log_every == 0 or last:
                self._log_interval(meter.interval(), bar)
            if (t.eval_every and p.global_step % t.eval_every == 0) or last:
                with meter.paused(), self.clock.phase("eval"):
                    self.evaluate()
            for hook in self.step_hooks:
                hook(p.global_step)
            if decision.snapshot:
                with meter.paused(), self.clock.phase("snapshot"):
                    self._save(meter.overall(), SnapshotRequest(final=last, urgent=decision.urgent))
            if self.snapshots.memory_due(p.global_step, last):  # its cost is the steps' (samples/s counts it)
                with self.clock.phase("snapshot"):
                    self.snapshots.save_memory(self.ctx, p.global_step, self.parts.state.own_state_dict())

    def _counted_step(self, batches: Iterator | None, meter: Throughput, bar: tqdm) -> Iterator | None:
        """One step from `batches` (None: the next epoch's), counted, its progress beaten, a sharded
        snapshot in flight polled; the batches of the next step (None when this one ended the epoch)."""
        p = self.parts.progress
        if batches is None:
            with self.clock.phase("data"):
                batches = self.parts.batches.epoch(p.epoch, p.epoch_sample)
        self._loss_sum += self._step(batches)
        self._loss_steps += 1
        meter.step()
        with self.clock.phase("data"):  # a stream reads the next step's batches here (core/stream.py)
            ended = p.advance(self.parts.batches.steps_from)
        if ended:
            batches = None  # the epoch is over: the next step starts the next one
        bar.update(1)
        self.guard.heartbeat.beat(p.global_step)
        if self.snapshots.shards_in_flight:  # published once every rank's shards are written
            with meter.paused(), self.clock.phase("snapshot"):
                self.snapshots.poll(self.ctx)
        return batches

    def _step(self, batches: Iterator) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches of the global batch (trainapp/core/layout.py);
        this rank's share of the step's mean loss, on the device."""
        parts, clock, layout = self.parts, self.clock, self.parts.progress.layout
        scaler, micro_steps, weight = parts.precision.scaler, layout.micro_steps(), layout.loss_weight
        loss_sum = torch.zeros((), device=self.ctx.device)
        for micro in range(micro_steps):
            clock.enter("data")
            batch = parts.task.to_device(next(batches))
            clock.enter("compute")
            seed_slot(self.settings.seed, parts.progress.global_step, layout.slot(micro))
            # All-reduce (reduce-scatter) only on the last micro-step; the others accumulate local gradients.
            with parts.strategy.no_sync(sync=micro == micro_steps - 1):
                with parts.precision.autocast():
                    loss = parts.task.loss(parts.train_model, batch)
                scaler.scale(loss * weight).backward()
            loss_sum += loss.detach()
        clock.enter("optim")
        if self.settings.train.grad_clip > 0:
            scaler.unscale_(parts.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(parts.model.parameters(), self.settings.train.grad_clip)
        scale = parts.precision.scale_tensor()
        before = scale.clone() if scale is not None else None
        scaler.step(parts.optimizer)  # skipped by the scaler when fp16 gradients hold inf/NaN
        scaler.update()
        if before is not None:
            after = parts.precision.scale_tensor()
            assert after is not None  # loss scaling is on, as it was before the step
            parts.progress.skipped += (after < before).to(torch.int64)
        parts.optimizer.zero_grad(set_to_none=True)
        parts.schedule.step()
        # Whatever the strategy does after a step (rank 0's running statistics on every rank), before
        # the EMA averages them.
        parts.strategy.after_step(parts.model, clock)
        if parts.ema is not None:
            parts.ema.update_parameters(parts.model)
        clock.enter("other")
        clock.step_done()
        return loss_sum * weight

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """The task's evaluation over the whole validation set: each entry `evaluate` returns, summed
        over batches and ranks, over the summed `count`, recorded as `val_<name>` (`val_count`: the count)."""
        parts = self.parts
        model = parts.ema.module if parts.ema is not None else parts.model
        was_training = model.training
        model.eval()
        sums: dict[str, torch.Tensor] = {}
        interrupted = False
        for padding, batch in parts.strategy.eval_batches(parts.val_loader):
            # The stop comes after the next step, so a partial eval is not recorded. The last step's eval
            # runs to the end: no stop follows it, the run ends normally. A sharded model's ranks must run
            # their forwards together: its eval always runs to the end.
            if (self.boundary.interrupts_eval() and parts.progress.global_step < parts.total_steps
                    and parts.strategy.interruptible_eval):
                interrupted = True
                break
            self.guard.heartbeat.beat()
            batch = parts.task.to_device(batch)
            with parts.precision.autocast():
                out = parts.task.evaluate(model, batch)
            if padding:
                continue
            for key, value in out.items():
                value = torch.as_tensor(value, device=self.ctx.device).detach().double().reshape(())
                sums[key] = sums[key] + value if key in sums else value
        model.train(was_training)
        # A rank may have had no validation batch (fewer samples than ranks): the names are agreed first.
        keys = sorted(set().union(*self.ctx.all_gather_objects(sorted(sums))))
        zero = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        vector = torch.stack([sums.get(k, zero) for k in keys] + [zero + interrupted])
        totals = dict(zip(keys + ["_interrupted"], self.ctx.all_reduce_sum(vector).tolist()))
        if totals.pop("_interrupted"):
            log.warning("eval at step %d cut short by a preemption notice; not recorded",
                        parts.progress.global_step)
            return self.last_eval
        count = totals.pop("count", 0.0)
        self.last_eval = {"step": parts.progress.global_step,
                          **{f"val_{k}": v / count if count else float("nan") for k, v in totals.items()},
                          "val_count": int(count) if float(count).is_integer() else count}
        self.records.eval(parts.progress.epoch, self.last_eval)
        return self.last_eval

    def _log_interval(self, samples_per_s: float, bar: tqdm) -> None:
        # The only host syncs of the loop: once per log interval. One all-gather carries every rank's
        # phase timings and loss sums.
        p, precision, ctx = self.parts.progress, self.parts.precision, self.ctx
        row = torch.cat([torch.tensor(self.clock.collect(), dtype=torch.float64, device=ctx.device),
                         torch.stack([self._loss_sum.double(),
                                      torch.tensor(float(self._loss_steps), dtype=torch.float64,
                                                  device=ctx.device)])])
        rows = ctx.all_gather(row).cpu()
        self.last_loss = (rows[:, -2].sum() / rows[:, -1].sum()).item()
        if self.clock.enabled:
            self.records.ranks(p.global_step, rows[:, :-2].tolist())
        record = {"step": p.global_step, "epoch": p.epoch, "loss": self.last_loss, "lr": self._current_lr(),
                  "samples_per_s": samples_per_s, "world_size": ctx.world_size,
                  "epoch_sample": p.epoch_sample, "skipped_steps": int(p.skipped.item())}
        if precision.scaler.is_enabled():
            scale = precision.scale_tensor()
            assert scale is not None  # loss scaling is on
            record["loss_scale"] = float(scale.item())
        self.records.train(record)
        bar.set_postfix(loss=f"{self.last_loss:.3f}", lr=f"{record['lr']:.3g}")
        self._loss_sum.zero_()
        self._loss_steps = 0

    def _current_lr(self) -> float:
        groups = self.parts.optimizer.param_groups
        return next((g["lr"] for g in groups if g["lr_mult"] == 1.0), groups[0]["lr"])

    def _save(self, samples_per_s: float, request: SnapshotRequest) -> None:
        p = self.parts.progress
        state = self.parts.state.state_dict(self.ctx.is_main)  # every rank: the RNG part gathers all ranks'
        shards = self.parts.state.shards()  # every rank's shard of a sharded model and optimizer
        digest = {} if state is None else self.parts.strategy.digest(self.parts.model)
        init = {"init": self.parts.init} if self.parts.init else {}  # where the run's weights started from
        meta = {**state["progress"], **digest, **init} if state is not None else None
        report: dict[str, Any] = {"step": p.global_step, "epoch": p.epoch, "loss": self.last_loss,
                                  "world_size": self.ctx.world_size, "samples_per_s": samples_per_s}
        if self.last_eval is not None and self.last_eval["step"] == p.global_step:
            report.update(val_metrics(self.last_eval))
        if self.records.last_ranks:  # the ranks' step times travel with the snapshot's report
            keys = ("rank", "host", "step_ms", "busy_ms")
            report["ranks"] = [{k: r[k] for k in keys} for r in self.records.last_ranks]
        try:
            self.snapshots.save(self.ctx, p.global_step, state, meta, report, request, shards)
        except BaseException:
            self.records.snapshot_failures(self.snapshots.failed)
            raise
        m = self.snapshots
        self.records.snapshot(p.global_step, failed=m.failed, failures=m.failures, background=m.async_write,
                              blocking_s=m.last_blocking_s, published=lambda: m.published_step)

    def _finish_snapshots(self, announce: bool = True) -> None:
        try:
            self.snapshots.finish(self.ctx, announce)
        finally:
            self.records.snapshot_failures(self.snapshots.failed)

    def _stop(self, stop: Stop, meter: Throughput, bar: tqdm) -> None:
        """Every rank, at the agreed step: the snapshot of this step (after any write in flight), the
        stop's record, then its exception out of train()."""
        bar.close()
        with meter.paused(), self.clock.phase("snapshot"):
            self._save(meter.overall(), SnapshotRequest(final=True, announce=stop.announce))
            self._finish_snapshots(announce=stop.announce)
            if stop.kind != "preempted":  # stopped for good, or resized: no restart reads these copies
                self.snapshots.close_memory()
        self.boundary.close()
        step = self.parts.progress.global_step
        fields, ending = stop.ending(step, str(self.snapshots.path_for(step)), self.ctx.rank)
        self.records.stop(stop.kind, **fields)
        raise ending

    def _finish(self, start_step: int, samples_per_s: float) -> dict[str, Any]:
        p = self.parts.progress
        if self.last_eval is None or self.last_eval["step"] != p.global_step:
            self.evaluate()
        assert self.last_eval is not None  # the last step's evaluation is never cut short
        summary = {"steps": p.global_step, "steps_this_run": p.global_step - start_step,
                   "final_loss": self.last_loss, **val_metrics(self.last_eval),
                   "world_size": self.ctx.world_size, "samples_per_s": samples_per_s,
                   "skipped_steps": int(p.skipped.item()), "snapshots": self.snapshots.where,
                   **({"data": dict(account)} if (account := self.parts.batches.account) else {}),
                   "state_bytes": parallel.state_bytes(self.parts.model, self.parts.optimizer, self.ctx),
                   "memory_tier": self.snapshots.memory_summary()}
        self._finish_snapshots()  # the final snapshot is on disk before the run says it ended
        self.snapshots.close_memory()  # a finished run's copies in memory are of no more use
        summary["model"] = export_final(self.ctx, self.parts, self.snapshots, self.settings.run_dir,
                                        self.settings.export)
        summary.update(self.records.end(summary))  # rank 0: the account of the run's wall time
        return summary
