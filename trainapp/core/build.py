"""`build(cfg, ctx, load)`: every part of a rank's run, made in the order the parts depend on each
other (the task, its data and model, precision, optimizer, state), then resumed from the newest valid
snapshot that `load` (the snapshot manager's) finds. The Trainer is handed the finished parts, as
pytorch/examples' multinode.py does; it never builds or loads anything itself.

Order matters in three places, each said where it happens: the model is made from the same seed on
every rank; the state's parts load in registration order, the data position first (the schedule's
horizon depends on it); and the strategy (trainapp/core/parallel/) readies the model before the
optimizer is made over its parameters, and wraps it only after the snapshot was loaded.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils.data import DataLoader

from trainapp.config import Config, changes
from trainapp.core import data, kernels, optim, parallel, stream
from trainapp.core.amp import Precision
from trainapp.core.layout import Layout
from trainapp.core.state import RngState, TrainState
from trainapp.core.stream import StreamBatches
from trainapp.core.task import BoundTask, bind
from trainapp.observe.records import StartFacts
from trainapp.snapshots.memory import TIER, TIER_NOTE, TIERS
from trainapp.streams.api import is_stream
from trainapp.weights import init as weights_init

if TYPE_CHECKING:
    from trainapp.group import DistContext

log = logging.getLogger(__name__)


@dataclass
class Parts:
    task: BoundTask
    batches: data.Batches
    val_loader: DataLoader
    model: torch.nn.Module
    """The plain module: snapshots, clipping and evaluation use it."""
    train_model: torch.nn.Module
    """What the step calls: the strategy's wrapper of the model, or the model itself."""
    strategy: parallel.Strategy
    """How the model is spread over the ranks (trainapp/core/parallel/): the loop asks it."""
    precision: Precision
    optimizer: torch.optim.Optimizer
    schedule: optim.Schedule
    ema: torch.optim.swa_utils.AveragedModel | None
    progress: data.Progress
    state: TrainState
    total_steps: int
    peak_lr: float
    resumed_from: str | None
    resumed_tier: str | None
    """Where the resumed state came from: `memory` (each rank's own node), `peer` (some rank's from another
    node's memory), `storage`; None for a fresh start."""
    resumed_tiers: list[str] | None
    """From memory: where each rank's state came from (`memory` or `peer`), in rank order."""
    resumed_note: str | None
    """Why copies in memory did not resume the run (another world size), when there were some."""
    config_changes: dict[str, list[Any]]
    """Each key whose value differs from the resumed snapshot's config: [there, here]."""
    init: dict[str, Any] | None = None
    """Where the weights the run started from came from (`init.from`: its path, kind and digest), kept
    across resumes; None for the task's own initialisation."""
    kernels: dict[str, Any] | None = None
    """The kernel choice (`train.deterministic`, trainapp/core/kernels.py), for the start record."""

    @property
    def parallel(self) -> dict[str, Any]:
        """What the strategy did to the model (strategy, compile, activation checkpointing): the start
        record's `parallel`."""
        return self.strategy.described

    def start_facts(self, world_size: int) -> StartFacts:
        """What the attempt's `start` record says of the parts (trainapp/observe/records.py)."""
        p = self.progress
        return StartFacts(step=p.global_step, epoch=p.epoch, epoch_sample=p.epoch_sample,
                          global_batch=p.global_batch, layout=p.layout.to_dict(),
                          micro_steps=[p.layout.micro_steps(r) for r in range(world_size)],
                          total_steps=self.total_steps, peak_lr=self.peak_lr, amp=self.precision.name,
                          amp_why=self.precision.why, kernels=self.kernels, parallel=self.parallel,
                          resumed=p.resumed, resumed_from=self.resumed_from, resumed_tier=self.resumed_tier,
                          resumed_tiers=self.resumed_tiers, resumed_note=self.resumed_note,
                          config_changes=self.config_changes, init=self.init)


def build(cfg: Config, ctx: DistContext,
          load: Callable[[DistContext], tuple[str, dict[str, Any]] | None] = lambda ctx: None,
          mark: Callable[[str], None] = lambda name: None, task: Any = None) -> Parts:
    """The parts of the run of `task` (default: the one `task.name` names), resumed from what
    `load(ctx)` finds ((where, state), or None to start fresh); `mark` notes on the start-up timeline
    when they were made ("built") and loaded ("loaded")."""
    cuda = ctx.device.type == "cuda"
    chosen = kernels.configure(cfg.train.deterministic, cuda)
    made: list[data.Progress] = []  # made once the data are known; the task may ask for its steps before
    if task is None:
        from trainapp.tasks.load import resolve  # a built-in task's module (torchvision...) only when named

        task = resolve(cfg)
    task = bind(task, ctx, name=cfg.task.name, seed=cfg.seed, run_dir=cfg.run.dir,
                steps_done=lambda: made[0].global_step if made else 0)
    strategy = parallel.make(cfg.parallel, ctx, task, cfg.run.dir)  # checked before anything is built
    train_ds, val_ds = task.datasets()
    model = task.model()  # after the datasets: a task may size its model by its data (classes, vocabulary)
    found, init = _init(cfg, ctx, model, load)  # before the EMA copy and the strategy: they start from it
    layout = Layout(cfg.train, ctx.world_size, ctx.rank, None if is_stream(train_ds) else len(train_ds))
    progress = data.Progress(layout, ctx.device)
    made.append(progress)
    batches, stream_part, horizon, val_loader = _data(cfg, ctx, task, train_ds, val_ds, progress)

    precision = Precision(cfg.amp, ctx.device)
    if precision.note and ctx.is_main:
        log.warning("%s", precision.note)
    ema = optim.build_ema(model, cfg.train.ema_decay)  # a copy of the whole, eager model: made first
    # Before the optimizer, which must hold the parameters as the strategy placed them (shards, maybe).
    strategy.prepare(model, ema.module if ema is not None else None, precision.dtype)
    opt = optim.build(model, cfg.optim, cfg.sched, ema, horizon, progress, fused=cuda,
                      groups=task.param_groups)
    state = TrainState({"progress": progress, "stream": stream_part,
                        **strategy.state(model, opt.optimizer, ema), "scheduler": opt.schedule,
                        "scaler": precision.scaler, "task": task.state,
                        "rng": RngState(ctx, cfg.seed, progress)},
                       records={"config": cfg.to_dict(), "init": init}, task_name=cfg.task.name)
    mark("built")
    state.check_loadable()  # else snapshots are written that the first restart cannot read
    diff = _resume(cfg, ctx, state, found) if found is not None else {}
    if stream_part is not None and found is not None:
        stream_part.settle(progress)  # the resumed epoch's rest may not fill a step: then it ends here
    mark("loaded")
    parallel.check_sync_bn(model, layout, cfg.task.name == "image_classification" and cfg.model.sync_bn)
    if ctx.is_main and layout.line():
        log.warning("%s", layout.line())
    train_model = strategy.wrap(model)  # last: the snapshot is in the model as placed
    return Parts(task=task, batches=batches, val_loader=val_loader, model=model, train_model=train_model,
                 strategy=strategy, precision=precision, optimizer=opt.optimizer,
                 schedule=opt.schedule, ema=opt.ema, progress=progress, state=state,
                 total_steps=opt.schedule.total_steps, peak_lr=opt.schedule.peak_lr,
                 resumed_from=found[0] if found else None,
                 resumed_tier=found[1].get(TIER, "storage") if found else None,
                 resumed_tiers=found[1].get(TIERS) if found else None,
                 resumed_note=found[1].get(TIER_NOTE) if found else None, config_changes=diff,
                 init=init, kernels=chosen)


def _init(cfg: Config, ctx: DistContext, model: torch.nn.Module,
          load: Callable[[DistContext], tuple[str, dict[str, Any]] | None],
          ) -> tuple[tuple[str, dict[str, Any]] | None, dict[str, Any] | None]:
    """(the snapshot to resume or None, where the run's weights started from). The snapshot is looked for
    first: a run with snapshots of its own resumes them and does not read `init.from` (its own weights are
    newer; the start is what its snapshot says). A run that starts fresh loads `init.from` into `model`."""
    found = load(ctx)
    if found is not None:
        if cfg.init.from_ and ctx.is_main:
            log.info("init.from=%s not read: the run resumes its own snapshot %s", cfg.init.from_, found[0])
        return found, found[1].get("init")
    if not cfg.init.from_:
        return None, None
    record = weights_init.apply(model, cfg.init.from_, cfg.init.exclude, cfg.init.strict)
    if ctx.is_main:
        log.info("init.from=%s: %d tensors loaded (%s%s)", cfg.init.from_, record["loaded"], record["kind"],
                 f", step {record['step']}" if record.get("step") is not None else "")
    return None, record


def _resume(cfg: Config, ctx: DistContext, state: TrainState,
            found: tuple[str, dict[str, Any]]) -> dict[str, list[Any]]:
    """Load the snapshot `found` into `state`, after its config is compared with this run's: the keys
    that differ (one line on rank 0), or ConfigError for a change that makes its state meaningless."""
    diff = changes.check_resume(found[1].get("config"), cfg.to_dict(), cfg.run.allow_changes, found[0])
    if diff and ctx.is_main:
        log.warning("resuming %s with config changes: %s", found[0], changes.line(diff))
    state.resume(found, cfg.run.dir)
    return diff


def _data(cfg: Config, ctx: DistContext, task: BoundTask, train: Any, val: Any, progress: data.Progress,
          ) -> tuple[data.Batches, StreamBatches | None, Callable[[], int], DataLoader]:
    """(the training batches, the stream's position when the train set is a stream (a part of the state),
    the horizon: steps done plus steps left, the validation loader)."""
    cuda = ctx.device.type == "cuda"
    stream_part: StreamBatches | None = None
    batches: data.Batches
    if is_stream(train):
        batches = stream_part = stream.make_batches(ctx, task, train, progress, seed=cfg.seed,
                                                    data_cfg=cfg.data, train_cfg=cfg.train)
        horizon: Callable[[], int] = functools.partial(stream.planned_steps, cfg.train.max_steps)
    else:
        seeded = task.random_items and data.draws_randomly(train)
        train = data.SeededItems(train, cfg.seed) if seeded else data.LocatedItems(train, "train")
        sampler = data.ResumableDistributedSampler(train, ctx.world_size, ctx.rank, shuffle=True,
                                                   seed=cfg.seed, layout=progress.layout)
        batches = data.EpochBatches(train, sampler, cfg.train.batch_size, cfg.data.num_workers, cuda,
                                    cfg.seed, task.collate, start_s=cfg.data.worker_start_s)
        horizon = functools.partial(data.plan_total, sampler, progress, cfg.train)
    if is_stream(val):
        val_loader = stream.val_loader(val, stream.listed(task.name, "val", val), ctx, cfg.train.batch_size,
                                       cfg.data.num_workers, cuda, task.collate,
                                       start_s=cfg.data.worker_start_s)
    else:
        val = data.LocatedItems(val, "val")
        val_sampler = data.ResumableDistributedSampler(val, ctx.world_size, ctx.rank, shuffle=False,
                                                       seed=cfg.seed)
        val_loader = data.make_loader(val, val_sampler, cfg.train.batch_size, cfg.data.num_workers, cuda,
                                      cfg.seed, task.collate, start_s=cfg.data.worker_start_s)
    return batches, stream_part, horizon, val_loader
