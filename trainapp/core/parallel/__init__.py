"""How the model is readied for training and spread over the ranks (`parallel.*`): one strategy object,
made by `make`, that `build` and the loop ask instead of branching on DDP or FSDP.

- strategy.py: the base and the order of `prepare` (activation checkpointing, compile, placement);
- ddp.py: every rank holds the whole model, DistributedDataParallel all-reduces the gradients;
- fsdp.py: FSDP2's `fully_shard`, every rank a shard of parameters, gradients and optimizer state;
- units.py: the units the three steps work on; checkpointing.py, compiling.py: two of the steps,
  compile_cache.py: the compiled code carried with the run;
- checks.py: what holds whatever the strategy (SyncBatchNorm against an uneven split, state bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainapp.core.parallel.checks import check_sync_bn, state_bytes
from trainapp.core.parallel.ddp import Replicated
from trainapp.core.parallel.fsdp import Sharded
from trainapp.core.parallel.strategy import Strategy

if TYPE_CHECKING:
    from trainapp.config import ParallelSection
    from trainapp.group import DistContext

__all__ = ["Strategy", "check_sync_bn", "make", "state_bytes"]


def make(cfg: ParallelSection, ctx: DistContext, task: Any = None,
         run_dir: str | Path | None = None) -> Strategy:
    """The strategy `cfg.strategy` names, for this rank (a run alone with `ddp` has nothing to replicate);
    `run_dir`: where a compiled run carries its compile cache."""
    if cfg.strategy == "fsdp":
        return Sharded(cfg, ctx, task, run_dir)
    return (Replicated if ctx.distributed else Strategy)(cfg, ctx, task, run_dir)
