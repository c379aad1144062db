"""`build(cfg, ctx, snapshots)`: every part of a run, made in the order the parts depend on each other,
then resumed from the newest valid snapshot. The Trainer is handed the finished parts, as
pytorch/examples' multinode.py does; it never builds or loads anything itself.

Order matters in three places, each said where it happens: the model is made from the same seed on
every rank; the snapshot's progress is read before the scheduler is made (the schedule's horizon
depends on it); and the snapshot is loaded into the plain module before it is wrapped in DDP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from trainapp.launch import dist
from trainapp.observe import tboard, timeline
from trainapp.core.amp import Precision
from trainapp.config import Config, ConfigError, TrainSection
from trainapp.core.data import ResumableDistributedSampler, build_datasets, make_loader
from trainapp.core.models import build_model
from trainapp.core.optim import build_ema, build_optimizer, build_scheduler, rescale, set_schedule
from trainapp.snapshots.snapshot import SnapshotManager
from trainapp.core.state import Progress, RngState, TrainState, seed_all

log = logging.getLogger(__name__)


@dataclass
class Parts:
    train_ds: Dataset
    sampler: ResumableDistributedSampler
    val_loader: DataLoader
    model: torch.nn.Module
    """The plain module: snapshots, clipping and evaluation use it."""
    train_model: torch.nn.Module
    """What the step calls: the DDP wrapper when distributed, else the plain module."""
    ddp: DDP | None
    precision: Precision
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    ema: torch.optim.swa_utils.AveragedModel | None
    progress: Progress
    state: TrainState
    total_steps: int
    resumed_from: str | None

    @property
    def global_batch(self) -> int:
        return self.progress.global_batch


def build(cfg: Config, ctx: dist.DistContext, snapshots: SnapshotManager) -> Parts:
    if (cfg.fault.kill_at_step is not None or cfg.fault.hang_at_step is not None) and cfg.fault.rank >= ctx.world_size:
        raise ConfigError(f"fault.rank={cfg.fault.rank}: must be < world size {ctx.world_size}")
    if cfg.fault.slow_rank is not None and cfg.fault.slow_rank >= ctx.world_size:
        raise ConfigError(f"fault.slow_rank={cfg.fault.slow_rank}: must be < world size {ctx.world_size}")
    if cfg.observe.tensorboard:
        tboard.check()
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
    train_ds, val_ds, num_classes = _datasets(cfg, ctx)
    global_batch = cfg.train.batch_size * cfg.train.grad_accum * ctx.world_size
    if global_batch > len(train_ds):
        raise ConfigError(f"train.batch_size={cfg.train.batch_size}: the global batch (batch_size*grad_accum*"
                          f"world_size={global_batch}) exceeds the {len(train_ds)} training samples")
    sampler = ResumableDistributedSampler(train_ds, ctx.world_size, ctx.rank, shuffle=True, seed=cfg.seed,
                                          global_batch=global_batch)
    val_sampler = ResumableDistributedSampler(val_ds, ctx.world_size, ctx.rank, shuffle=False, seed=cfg.seed)
    val_loader = make_loader(val_ds, val_sampler, cfg.train.batch_size, cfg.data.num_workers, cuda, cfg.seed)

    model = _model(cfg, ctx, num_classes)
    precision = Precision(cfg.amp, ctx.device)
    if precision.note and ctx.is_main:
        log.warning("%s", precision.note)
    optimizer = build_optimizer(model, cfg.optim, global_batch, fused=cuda)
    ema = build_ema(model, cfg.train.ema_decay)
    seed_all(cfg.seed + 1000 * ctx.rank)  # ranks differ in dropout/augmentation randomness

    progress = Progress(ctx.world_size, global_batch, ctx.device)
    timeline.mark("built")
    found = snapshots.load(ctx)
    if found is not None:
        progress.load_state_dict(found[1]["progress"])  # first: the schedule's horizon depends on it
    total_steps = plan_total(sampler, progress, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.sched, total_steps)
    state = TrainState({"progress": progress, "model": model, "optimizer": optimizer, "scheduler": scheduler,
                        "scaler": precision.scaler, "ema": ema, "rng": RngState(ctx, cfg.seed, progress)},
                       records={"config": cfg.to_dict()})
    if found is not None:
        _resume(cfg, ctx, state, found)
        set_schedule(scheduler, cfg.sched, total_steps)  # the saved schedule ends where that run would have
        _rescale_lr(cfg, ctx, optimizer, scheduler, progress)

    timeline.mark("loaded")
    ddp = None
    if ctx.distributed:  # wrap last: the snapshot went into the plain module
        ddp = DDP(model, device_ids=[ctx.device.index] if cuda else None, gradient_as_bucket_view=True)
    return Parts(train_ds, sampler, val_loader, model, ddp or model, ddp, precision, optimizer, scheduler, ema,
                 progress, state, total_steps, found[0] if found else None)


def _datasets(cfg: Config, ctx: dist.DistContext) -> tuple[Dataset, Dataset, int]:
    train_ds, val_ds, num_classes = build_datasets(cfg.data, cfg.seed, ctx.is_main, lambda: dist.barrier(ctx))
    if cfg.model.num_classes is not None and cfg.model.num_classes != num_classes:
        raise ConfigError(f"model.num_classes={cfg.model.num_classes}: the dataset has {num_classes} classes; "
                          "set it equal or leave it empty")
    return train_ds, val_ds, num_classes


def _model(cfg: Config, ctx: dist.DistContext, num_classes: int) -> torch.nn.Module:
    seed_all(cfg.seed)  # identical init on every rank (DDP would broadcast rank 0's anyway)
    model = build_model(cfg.model.name, num_classes).to(ctx.device)
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.model.sync_bn and ctx.distributed:
        if ctx.device.type == "cuda":
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        elif ctx.is_main:
            log.warning("model.sync_bn=true ignored: SyncBatchNorm needs CUDA; plain BatchNorm on CPU")
    return model


def plan_total(sampler: ResumableDistributedSampler, progress: Progress, train: TrainSection) -> int:
    """Steps done plus steps left: the rest of this epoch and the full epochs after it."""
    left = 0
    if progress.epoch < train.epochs:
        left = sampler.steps_from(progress.epoch_sample) + (train.epochs - progress.epoch - 1) * sampler.steps_from(0)
    total = progress.global_step + left
    return min(total, train.max_steps) if train.max_steps is not None else total


def _resume(cfg: Config, ctx: dist.DistContext, state: TrainState, found: tuple[str, dict[str, Any]]) -> None:
    path, snap = found
    try:
        state.load_state_dict(snap)
    except (RuntimeError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [e.__class__.__name__])[0]
        raise ConfigError(f"run.dir={cfg.run.dir}: snapshot {path} does not fit this config ({first}); use a new "
                          "run.dir or the config it was written with") from None
    p = state.parts["progress"]
    log.info("resumed from %s: step=%d epoch=%d epoch_sample=%d", path, p.global_step, p.epoch, p.epoch_sample)


def _rescale_lr(cfg: Config, ctx: dist.DistContext, optimizer, scheduler, progress: Progress) -> None:
    """Resumed at another global batch (another world size): the peak LR follows `optim.lr_scaling`."""
    before = progress.resumed["global_batch"]
    if before != progress.global_batch:
        peak = rescale(optimizer, scheduler, cfg.optim, progress.global_batch)
        log.info("global batch %d -> %d (world size %d -> %d): peak lr rescaled to %.4g", before,
                 progress.global_batch, progress.resumed["world_size"], ctx.world_size, peak)
