"""The training loop: DDP + autocast, gradient accumulation, distributed eval, rank-0 snapshots.

`run(cfg)` is the whole job. It does not know who launched it: alone, torchrun or a Ray Train worker
all look the same from here (ranks in the environment, maybe a process group already created).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from trainapp import dist, logs, net
from trainapp.amp import Precision
from trainapp.config import Config, ConfigError
from trainapp.data import ResumableDistributedSampler, build_datasets, make_loader, set_epoch
from trainapp.models import build_model
from trainapp.optim import build_ema, build_optimizer, build_scheduler, rescale, scaled_lr, set_schedule
from trainapp.snapshot import SnapshotManager, params_sha256

log = logging.getLogger(__name__)

# With fp16 the GradScaler skips the optimizer step on overflow; the schedule must still advance, and
# torch's "scheduler.step() before optimizer.step()" warning is a false alarm then.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")


def rng_state() -> dict[str, Any]:
    """This process's generators as plain Python values (bytes, ints): they travel through
    gather_object and load with torch.load(weights_only=True)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "python": random.getstate(),
        "numpy": (kind, keys.tobytes(), pos, has_gauss, cached),
        "torch": torch.get_rng_state().numpy().tobytes(),
        "cuda": [s.numpy().tobytes() for s in cuda],
    }


def _byte_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached))
    torch.set_rng_state(_byte_tensor(state["torch"]))
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all([_byte_tensor(s) for s in state["cuda"]])


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: Config, ctx: dist.DistContext, snapshots: SnapshotManager | None = None):
        self.cfg, self.ctx = cfg, ctx
        self.device = ctx.device
        self.run_dir = Path(cfg.run.dir)
        t = cfg.train
        if cfg.fault.kill_at_step is not None and cfg.fault.rank >= ctx.world_size:
            raise ConfigError(f"fault.rank={cfg.fault.rank}: must be < world size {ctx.world_size}")
        self.snapshots = snapshots or SnapshotManager(self.run_dir / "snapshots", cfg.snapshot.every_steps,
                                                      cfg.snapshot.keep, async_write=cfg.snapshot.async_,
                                                      write_delay_s=cfg.fault.snapshot_write_delay_s)
        self.metrics = logs.MetricsWriter(self.run_dir / "metrics.jsonl" if ctx.is_main else None)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.backends.cudnn.benchmark = True

        # Data
        self.train_ds, self.val_ds, num_classes = build_datasets(cfg.data, cfg.seed, ctx.is_main,
                                                                 lambda: dist.barrier(ctx))
        if cfg.model.num_classes is not None and cfg.model.num_classes != num_classes:
            raise ConfigError(f"model.num_classes={cfg.model.num_classes}: the dataset has {num_classes} classes; "
                              "set it equal or leave it empty")
        self.global_batch = t.batch_size * t.grad_accum * ctx.world_size
        if self.global_batch > len(self.train_ds):
            raise ConfigError(f"train.batch_size={t.batch_size}: the global batch (batch_size*grad_accum*world_size="
                              f"{self.global_batch}) exceeds the {len(self.train_ds)} training samples")
        self.sampler = ResumableDistributedSampler(self.train_ds, ctx.world_size, ctx.rank, shuffle=True,
                                                   seed=cfg.seed, global_batch=self.global_batch)
        val_sampler = ResumableDistributedSampler(self.val_ds, ctx.world_size, ctx.rank, shuffle=False, seed=cfg.seed)
        self.val_loader = make_loader(self.val_ds, val_sampler, t.batch_size, cfg.data.num_workers, cuda, cfg.seed)

        # Model: identical init on every rank (DDP would broadcast rank 0's anyway).
        seed_all(cfg.seed)
        model = build_model(cfg.model.name, num_classes).to(self.device)
        self.channels_last = cfg.model.channels_last
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model
        self.precision = Precision(cfg.amp, self.device)
        if self.precision.note and ctx.is_main:
            log.warning("%s", self.precision.note)
        self.optimizer = build_optimizer(model, cfg.optim, self.global_batch, fused=cuda)
        self.ema = build_ema(model, t.ema_decay)
        seed_all(cfg.seed + 1000 * ctx.rank)  # ranks differ in dropout/augmentation randomness

        self.global_step, self.epoch, self.epoch_sample = 0, 0, 0
        self._skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        self.resumed: dict[str, Any] | None = None
        state = self._load_newest()
        self.total_steps = self._plan_total()
        self.scheduler = build_scheduler(self.optimizer, cfg.sched, self.total_steps)
        if state is not None:
            self._restore(state)

        # Wrap last: the snapshot was loaded into the plain module. self.model stays the plain module
        # (DDP's .module), which is what snapshots, clipping and evaluation use.
        if cfg.model.sync_bn and ctx.distributed:
            if cuda:
                self.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
            else:
                log.warning("model.sync_bn=true ignored: SyncBatchNorm needs CUDA; plain BatchNorm on CPU")
        self.ddp = None
        if ctx.distributed:
            self.ddp = DDP(self.model, device_ids=[self.device.index] if cuda else None,
                           gradient_as_bucket_view=True)
        self.train_model = self.ddp or self.model
        if state is not None:
            # Last, so nothing above shifts the generators the uninterrupted run would have had.
            rngs = state["rng"]
            if ctx.rank < len(rngs):
                set_rng_state(rngs[ctx.rank])
            else:
                seed_all(cfg.seed + 1000 * ctx.rank + self.global_step)

    # ------------------------------------------------------------------------------------------
    # Snapshots

    def _load_newest(self) -> dict[str, Any] | None:
        found = self.snapshots.load(self.ctx)
        if found is None:
            return None
        path, state = found
        self.resumed = {"path": path, **state["progress"]}
        p = state["progress"]
        self.global_step, self.epoch, self.epoch_sample = p["global_step"], p["epoch"], p["epoch_sample"]
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.precision.scaler.load_state_dict(state["scaler"])
            if self.ema is not None:
                if state["ema"] is None:
                    raise ValueError("the snapshot has no EMA weights")
                self.ema.load_state_dict(state["ema"])
        except (RuntimeError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0]
            raise ConfigError(f"run.dir={self.cfg.run.dir}: snapshot {self.resumed['path']} does not fit this "
                              f"config ({first}); use a new run.dir or the config it was written with") from None
        self._skipped.fill_(state["progress"].get("skipped_steps", 0))
        set_schedule(self.scheduler, self.cfg.sched, self.total_steps)
        prev_batch = state["progress"]["global_batch"]
        if prev_batch != self.global_batch:
            peak = rescale(self.optimizer, self.scheduler, self.cfg.optim, self.global_batch)
            log.info("global batch %d -> %d (world size %d -> %d): peak lr rescaled to %.4g",
                     prev_batch, self.global_batch, state["progress"]["world_size"], self.ctx.world_size, peak)
        log.info("resumed from %s: step=%d epoch=%d epoch_sample=%d", self.resumed["path"], self.global_step,
                 self.epoch, self.epoch_sample)

    def _save(self, metrics: dict[str, Any]) -> None:
        rngs = dist.gather_objects(self.ctx, rng_state())  # every rank's generators, not just rank 0's
        state = meta = None
        if self.ctx.is_main:
            progress = {"global_step": self.global_step, "epoch": self.epoch, "epoch_sample": self.epoch_sample,
                        "world_size": self.ctx.world_size, "global_batch": self.global_batch,
                        "skipped_steps": int(self._skipped.item())}
            state = {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.precision.scaler.state_dict(),
                "ema": self.ema.state_dict() if self.ema is not None else None,
                "progress": progress,
                "rng": rngs,
                "config": self.cfg.to_dict(),
            }
            meta = {**progress, "params_sha256": params_sha256(self.model)}
        self.snapshots.save(self.ctx, self.global_step, state, meta, metrics)
        self.metrics.write("snapshot", step=self.global_step, blocking_s=round(self.snapshots.last_blocking_s, 4),
                           background=self.snapshots.async_write)

    # ------------------------------------------------------------------------------------------
    # Steps

    def _plan_total(self) -> int:
        """Steps done plus steps left: the rest of this epoch and the full epochs after it."""
        n, gb, epochs = len(self.train_ds), self.global_batch, self.cfg.train.epochs
        left = 0
        if self.epoch < epochs:
            left = (n - self.epoch_sample) // gb + (epochs - self.epoch - 1) * (n // gb)
        total = self.global_step + left
        if self.cfg.train.max_steps is not None:
            total = min(total, self.cfg.train.max_steps)
        return total

    def _run_step(self, batches) -> torch.Tensor:
        accum, scaler = self.cfg.train.grad_accum, self.precision.scaler
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(accum):
            x, y = next(batches)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            # All-reduce only on the last micro-step; the others just accumulate local gradients.
            sync = self.ddp is None or micro == accum - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with self.precision.autocast():
                    loss = F.cross_entropy(self.train_model(x), y)
                scaler.scale(loss / accum).backward()
            loss_sum += loss.detach()
        if self.cfg.train.grad_clip > 0:
            scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        scale = self.precision.scale_tensor()
        before = scale.clone() if scale is not None else None
        scaler.step(self.optimizer)  # skipped by the scaler when fp16 gradients hold inf/NaN
        scaler.update()
        if before is not None:
            self._skipped += (self.precision.scale_tensor() < before).to(torch.int64)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        return loss_sum / accum

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Accuracy over the whole validation set: correct/total summed across ranks."""
        model = self.ema.module if self.ema is not None else self.model
        was_training = model.training
        model.eval()
        stats = torch.zeros(3, dtype=torch.float64, device=self.device)  # correct, total, loss sum
        for x, y in self.val_loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with self.precision.autocast():
                out = model(x)
            stats[0] += (out.argmax(1) == y).sum()
            stats[1] += y.numel()
            stats[2] += F.cross_entropy(out.float(), y, reduction="sum")
        model.train(was_training)
        correct, total, loss = dist.all_reduce_sum(self.ctx, stats).tolist()
        result = {"step": self.global_step, "val_acc": correct / max(total, 1), "val_loss": loss / max(total, 1),
                  "val_samples": int(total)}
        self.metrics.write("eval", epoch=self.epoch, **result)
        log.info(logs.kv(**result))
        return result

    def _maybe_fault(self) -> None:
        f = self.cfg.fault
        if f.kill_at_step != self.global_step or f.rank != self.ctx.rank:
            return
        marker = self.run_dir / f"fault-fired-step{f.kill_at_step}-rank{f.rank}"
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        with open(marker, "w") as fh:
            fh.write(f"{time.time()}\n")
            fh.flush()
            os.fsync(fh.fileno())
        log.warning("fault drill: rank %d kills itself with SIGKILL at step %d", f.rank, f.kill_at_step)
        self.metrics.close()
        os.kill(os.getpid(), signal.SIGKILL)

    def _current_lr(self) -> float:
        groups = self.optimizer.param_groups
        return next((g["lr"] for g in groups if g["lr_mult"] == 1.0), groups[0]["lr"])

    # ------------------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        cfg, ctx = self.cfg, self.ctx
        t = cfg.train
        network = dist.gather_objects(ctx, net.current.to_dict() if net.current else None)
        self.metrics.write("start", step=self.global_step, epoch=self.epoch, epoch_sample=self.epoch_sample,
                           world_size=ctx.world_size, global_batch=self.global_batch, total_steps=self.total_steps,
                           peak_lr=scaled_lr(cfg.optim, self.global_batch), amp=self.precision.name,
                           backend=ctx.backend, device=str(self.device), threads=torch.get_num_threads(),
                           interop_threads=torch.get_num_interop_threads(),
                           restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                           resumed_from=self.resumed["path"] if self.resumed else None,
                           resumed_step=self.resumed["global_step"] if self.resumed else None,
                           resumed_world_size=self.resumed["world_size"] if self.resumed else None,
                           network=network, config=cfg.to_dict())
        log.info("config %s", json.dumps(cfg.to_dict(), separators=(",", ":")))
        log.info(logs.kv(world_size=ctx.world_size, backend=ctx.backend, device=self.device, amp=self.precision.name,
                         global_batch=self.global_batch, total_steps=self.total_steps, start_step=self.global_step))
        start_step = self.global_step
        bar = tqdm(total=self.total_steps, initial=self.global_step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (ctx.is_main and t.progress), mininterval=0.5)
        loss_acc = torch.zeros((), device=self.device)
        steps_in_interval, interval_start, train_time = 0, time.perf_counter(), 0.0
        last_loss, last_eval, batches = float("nan"), None, None
        self.train_model.train()
        while self.global_step < self.total_steps:
            if batches is None:
                set_epoch(self.train_ds, self.sampler, self.epoch, self.epoch_sample)
                loader = make_loader(self.train_ds, self.sampler, t.batch_size, cfg.data.num_workers,
                                     self.device.type == "cuda", cfg.seed * 100_003 + self.epoch)
                batches = iter(loader)
            loss_acc += self._run_step(batches)
            steps_in_interval += 1
            self.global_step += 1
            self.epoch_sample += self.global_batch
            if len(self.train_ds) - self.epoch_sample < self.global_batch:
                self.epoch, self.epoch_sample, batches = self.epoch + 1, 0, None
            bar.update(1)
            last = self.global_step == self.total_steps
            if self.global_step % t.log_every == 0 or last:
                # The only host syncs of the loop: once per log interval.
                elapsed = time.perf_counter() - interval_start
                train_time += elapsed
                totals = dist.all_reduce_sum(ctx, torch.stack([loss_acc, torch.tensor(float(steps_in_interval),
                                                                                     device=self.device)]))
                last_loss = (totals[0] / totals[1]).item()
                record = {"step": self.global_step, "epoch": self.epoch, "loss": last_loss, "lr": self._current_lr(),
                          "samples_per_s": steps_in_interval * self.global_batch / max(elapsed, 1e-9),
                          "world_size": ctx.world_size, "epoch_sample": self.epoch_sample,
                          "skipped_steps": int(self._skipped.item())}
                if self.precision.scaler.is_enabled():
                    record["loss_scale"] = float(self.precision.scale_tensor().item())
                self.metrics.write("train", **record)
                log.info(logs.kv(**record))
                bar.set_postfix(loss=f"{last_loss:.3f}", lr=f"{record['lr']:.3g}")
                loss_acc.zero_()
                steps_in_interval, interval_start = 0, time.perf_counter()
            if (t.eval_every and self.global_step % t.eval_every == 0) or last:
                last_eval = self.evaluate()
                interval_start = time.perf_counter()
            self._maybe_fault()
            if self.snapshots.due(self.global_step, last):
                report = {"step": self.global_step, "epoch": self.epoch, "loss": last_loss,
                          "world_size": ctx.world_size,
                          "samples_per_s": (self.global_step - start_step) * self.global_batch / max(train_time, 1e-9)}
                if last_eval is not None and last_eval["step"] == self.global_step:
                    report["val_acc"] = last_eval["val_acc"]
                self._save(report)
                interval_start = time.perf_counter()
        bar.close()
        if last_eval is None or last_eval.get("step") != self.global_step:
            last_eval = self.evaluate()
        steps_run = self.global_step - start_step
        summary = {
            "steps": self.global_step, "steps_this_run": steps_run, "final_loss": last_loss,
            "val_acc": last_eval["val_acc"], "world_size": ctx.world_size,
            "samples_per_s": steps_run * self.global_batch / train_time if train_time > 0 else 0.0,
            "skipped_steps": int(self._skipped.item()), "snapshots": str(self.snapshots.root),
        }
        self.snapshots.wait()  # the final snapshot is on disk before the run says it ended
        self.metrics.write("end", **summary)
        self.metrics.close()
        return summary


def run(cfg: Config) -> dict[str, Any]:
    """The whole job on this process: set up distributed, train, evaluate, tear down what we created."""
    logs.setup_from_env()  # the network check logs before the group exists
    ctx = dist.setup(cfg.dist.timeout_s, cfg.network)
    logs.setup(ctx.rank, ctx.world_size)
    try:
        summary = Trainer(cfg, ctx).train()
    finally:
        dist.teardown(ctx)
    return {**summary, "rank": ctx.rank}
