"""Optimizer, parameter groups, learning-rate scaling and schedule, EMA weights."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from trainapp.config import ConfigError, OptimSection, SchedSection


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
            raise ConfigError(f"optim.lr_mult key {prefix!r} matches no parameter; names start with {', '.join(tops)}")
    groups: dict[tuple[bool, float], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.ndim > 1
        mult = _lr_mult(name, cfg.lr_mult)
        g = groups.setdefault((decay, mult), {"params": [], "weight_decay": cfg.weight_decay if decay else 0.0,
                                                "lr_mult": mult})
        g["params"].append(p)
    return list(groups.values())


def build_optimizer(model: nn.Module, cfg: OptimSection, global_batch: int, fused: bool = False) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg)
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


def build_ema(model: nn.Module, decay: float) -> AveragedModel | None:
    if decay <= 0:
        return None
    # use_buffers: BatchNorm running statistics are averaged too, so the EMA model evaluates sanely.
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
