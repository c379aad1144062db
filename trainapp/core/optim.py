"""Optimizer, parameter groups, learning-rate scaling and schedule, EMA weights.

`build` makes all of them at once. The schedule is a stateful part of its own (`Schedule`): loading a
snapshot into it aims the resumed schedule at this run's horizon and, after a resize, rescales the
peak LR to the new global batch, so resume-time LR logic lives here and nowhere else.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from trainapp.config import ConfigError, OptimSection, SchedSection

if TYPE_CHECKING:
    from trainapp.core.data import Progress

log = logging.getLogger(__name__)


def scaled_lr(cfg: OptimSection, global_batch: int) -> float:
    """`optim.lr` scaled from `optim.base_batch_size` to the actual global batch."""
    ratio = global_batch / cfg.base_batch_size
    return cfg.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.lr_scaling]


def _lr_mult(name: str, mults: dict[str, float]) -> float:
    best = ""
    for prefix in mults:
        if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return mults[best] if best else 1.0


def param_groups(model: nn.Module, cfg: OptimSection) -> list[dict]:
    """Groups by (weight decay on/off, LR multiplier). Biases and norm weights (1-d) get no decay."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for prefix in cfg.lr_mult:
        if not any(n == prefix or n.startswith(prefix + ".") for n in names):
            tops = sorted({n.split(".")[0] for n in names})
            raise ConfigError(f"optim.lr_mult key {prefix!r} matches no parameter; "
                              f"names start with {', '.join(tops)}")
    groups: dict[tuple[bool, float], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.ndim > 1
        mult = _lr_mult(name, cfg.lr_mult)
        g = groups.setdefault((decay, mult), {"params": [],
                                              "weight_decay": cfg.weight_decay if decay else 0.0,
                                              "lr_mult": mult})
        g["params"].append(p)
    return list(groups.values())


def task_groups(groups: list[dict], cfg: OptimSection) -> list[dict]:
    """The task's own parameter groups (its `param_groups(model)`), with trainapp's defaults for the
    options a group does not set: `optim.weight_decay` and an LR multiplier of 1."""
    if cfg.lr_mult:
        raise ConfigError(f"optim.lr_mult={cfg.lr_mult}: the task sets its own param_groups; give a group an "
                          "lr_mult there instead")
    out = []
    for g in groups:
        g = dict(g)
        g["params"] = list(g["params"])
        g.setdefault("weight_decay", cfg.weight_decay)
        g.setdefault("lr_mult", 1.0)
        out.append(g)
    return out


def build_optimizer(model: nn.Module, cfg: OptimSection, global_batch: int, fused: bool = False,
                    groups: list[dict] | None = None) -> torch.optim.Optimizer:
    """SGD or AdamW over `groups` (the task's, else trainapp's `param_groups`), at the scaled peak LR."""
    groups = task_groups(groups, cfg) if groups is not None else param_groups(model, cfg)
    peak = scaled_lr(cfg, global_batch)
    for g in groups:
        g["lr"] = peak * g["lr_mult"]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=peak, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    return torch.optim.AdamW(groups, lr=peak, betas=(cfg.momentum, 0.999), fused=fused or None)


class WarmupCosine:
    """LR factor at optimizer step `s`: linear warmup to 1, then cosine down to `min_ratio` at `total`."""

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, max(total, 1), min_ratio

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / (self.warmup + 1)
        progress = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg: SchedSection, total_steps: int) -> LambdaLR:
    return LambdaLR(opt, WarmupCosine(cfg.warmup_steps, total_steps, cfg.min_lr_ratio))


def set_schedule(sched: LambdaLR, cfg: SchedSection, total_steps: int) -> None:
    """Point a (resumed) scheduler at a new horizon; its step count is kept."""
    sched.lr_lambdas = [WarmupCosine(cfg.warmup_steps, total_steps, cfg.min_lr_ratio)] * len(sched.lr_lambdas)


def rescale(opt: torch.optim.Optimizer, sched: LambdaLR, cfg: OptimSection, global_batch: int) -> float:
    """After resuming at another global batch size: new base LRs, current LRs recomputed. Returns the peak."""
    peak = scaled_lr(cfg, global_batch)
    sched.base_lrs = [peak * g["lr_mult"] for g in opt.param_groups]
    for g, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
        g["initial_lr"] = base
        g["lr"] = base * fn(sched.last_epoch)
    return peak


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's shard on this rank, sharing its storage.
    return t.to_local() if hasattr(t, "to_local") else t


def ema_multi_avg_fn(decay: float) -> Callable[..., None]:
    """`get_ema_multi_avg_fn` over each rank's own shards: the same arithmetic as on a whole model, with
    no communication (an FSDP model's parameters are DTensors, its buffers plain tensors, and one
    foreach call cannot mix them)."""
    lerp = get_ema_multi_avg_fn(decay)

    def average(ema: list[torch.Tensor], current: list[torch.Tensor], n_averaged: torch.Tensor) -> None:
        lerp([_local(t) for t in ema], [_local(t) for t in current], n_averaged)

    return average


def build_ema(model: nn.Module, decay: float) -> AveragedModel | None:
    """The averaged copy of `model`, or None when `decay` is 0. Made from the whole model: an FSDP run
    shards the copy after it, as it shards the model."""
    if decay <= 0:
        return None
    # use_buffers: BatchNorm running statistics are averaged too, so the EMA model evaluates sanely.
    return AveragedModel(model, multi_avg_fn=ema_multi_avg_fn(decay), use_buffers=True)


class Schedule:
    """The LR schedule as a part of the run's state: warmup + cosine to `horizon()` steps (steps done
    plus steps left). `load_state_dict` resumes the saved schedule's step count and points it at this
    run's horizon (the saved one ended where that run would have), and when the global batch changed
    since the snapshot (another world size), rescales the peak LR by `optim.lr_scaling`. `progress`
    says what the snapshot's run was: it loads before this part."""

    def __init__(self, optimizer: torch.optim.Optimizer, optim: OptimSection, sched: SchedSection,
                 horizon: Callable[[], int], progress: Progress) -> None:
        (self.optimizer, self.optim, self.sched,
         self.horizon, self.progress) = optimizer, optim, sched, horizon, progress
        self.total_steps = horizon()
        self.scheduler = build_scheduler(optimizer, sched, self.total_steps)

    def step(self) -> None:
        self.scheduler.step()

    @property
    def peak_lr(self) -> float:
        """The LR of the groups without a multiplier at the schedule's peak (for the start record), at
        the global batch the run has once a snapshot is loaded."""
        return scaled_lr(self.optim, self.progress.global_batch)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
        self.total_steps = self.horizon()
        set_schedule(self.scheduler, self.sched, self.total_steps)
        p = self.progress
        assert p.resumed is not None  # the data position, loaded before this part
        before = p.resumed["global_batch"]
        if before != p.global_batch:
            peak = rescale(self.optimizer, self.scheduler, self.optim, p.global_batch)
            log.info("global batch %d -> %d (world size %d -> %d): peak lr rescaled to %.4g", before,
                     p.global_batch, p.resumed["world_size"], p.world_size, peak)


@dataclass
class Optimization:
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    ema: AveragedModel | None


def build(model: nn.Module, optim: OptimSection, sched: SchedSection, ema: AveragedModel | None,
          horizon: Callable[[], int], progress: Progress, fused: bool = False,
          groups: Callable[[torch.nn.Module], list[dict] | None] | None = None) -> Optimization:
    """The optimizer over `model`'s parameter groups (or the task's `groups`) and its schedule to
    `horizon()`, with the EMA weights (`build_ema`, made before an FSDP model is sharded)."""
    # The task's groups are asked for here, over the parameters as they are now: an FSDP model's are the
    # sharded ones that replaced the module's own (trainapp/core/parallel/fsdp.py).
    optimizer = build_optimizer(model, optim, progress.global_batch, fused=fused,
                                groups=groups(model) if groups is not None else None)
    return Optimization(optimizer, Schedule(optimizer, optim, sched, horizon, progress), ema)
