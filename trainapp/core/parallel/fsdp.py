"""`parallel.strategy=fsdp`: FSDP2's `fully_shard` on the units (trainapp/core/parallel/units.py), then on
the model itself: each rank keeps a shard of every parameter, its gradient and its optimizer state; a
unit gathers its parameters for its own forward and backward. Autocast over fp32 parameters, as under
DDP, or parameters gathered in autocast's dtype (`parallel.fsdp_param_dtype=amp`, BatchNorm units kept
fp32). The optimizer is made over the sharded parameters, so after `place`, and the snapshot is loaded
into the sharded state (trainapp/core/state.py's `ShardedState`). A run alone with this strategy is not
sharded, but keeps the sharded snapshots' format (torch.distributed.checkpoint), so that it resumes at
any world size.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, cast

import torch

from trainapp.config import ParallelSection
from trainapp.core import torch_private
from trainapp.core.parallel.strategy import Strategy
from trainapp.core.parallel.units import units
from trainapp.core.state import ShardedState

if TYPE_CHECKING:
    import contextlib

    from torch.distributed.fsdp import FSDPModule
    from torch.utils.data import DataLoader

    from trainapp.group import DistContext
    from trainapp.observe.timings import PhaseClock

log = logging.getLogger(__name__)


class Sharded(Strategy):
    name = "fsdp"

    def __init__(self, cfg: ParallelSection, ctx: DistContext, task: Any = None,
                 run_dir: str | Path | None = None) -> None:
        super().__init__(cfg, ctx, task, run_dir)
        self.sharded = ctx.distributed
        self.interruptible_eval = not self.sharded  # every forward of a sharded model is a collective

    def place(self, model: torch.nn.Module, copy: torch.nn.Module | None, dtype: torch.dtype | None) -> None:
        if self.sharded:  # the EMA copy sharded alike, its shards beside the model's
            shard(model, self.cfg, self.task, copy, dtype)

    def state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              ema: torch.nn.Module | None) -> dict[str, Any]:
        # The model and optimizer together: every rank's shard, named by parameter (DCP).
        return {"model": ShardedState(model, optimizer), "optimizer": None,
                "ema": ShardedState(ema) if ema is not None else None}

    def time_waits(self, clock: PhaseClock) -> None:
        if self.sharded and self.train_model is not None:
            time_waits(self.train_model, clock.wait_begins, clock.wait_ends)

    def no_sync(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        if self.sharded:
            cast("FSDPModule", self.train_model).set_requires_gradient_sync(sync)  # fully_shard made it one
        return super().no_sync(sync)

    def after_step(self, model: torch.nn.Module, clock: PhaseClock) -> None:
        super().after_step(model, clock)
        if self.sharded:  # a peer late for it is waited for here
            with clock.waiting():
                buffers_from_rank0(model, self.ctx)

    def _eval_batches(self, loader: DataLoader) -> Iterator[tuple[bool, Any]]:
        return _padded(loader, self.ctx) if self.sharded else super()._eval_batches(loader)

    def digest(self, model: torch.nn.Module) -> dict[str, str]:
        # The digest would gather the whole model onto rank 0 at every snapshot, what FSDP is used to
        # avoid: `trainapp inspect` computes it from the shards instead.
        return {} if self.sharded else super().digest(model)


def shard(model: torch.nn.Module, cfg: ParallelSection, task: Any = None, copy: torch.nn.Module | None = None,
          dtype: torch.dtype | None = None) -> None:
    """`fully_shard` on the units, innermost first, then on the model; the same on `copy` (the EMA copy
    of the model), whose shards then lie beside the model's. Parameters gathered in fp32, or in `dtype`
    (autocast's) with `parallel.fsdp_param_dtype=amp`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = dtype if cfg.fsdp_param_dtype == "amp" else None
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    shard_as = functools.partial(fully_shard, reshard_after_forward=cfg.reshard_after_forward)
    for module in (model, copy) if copy is not None else (model,):
        # FSDP2 shards contiguous parameters only (a channels-last conv's are not).
        for p in module.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
        # A BatchNorm's fp32 running statistics need fp32 weights: with low-precision gathers each is a
        # unit of its own, kept fp32 (autocast casts what follows it back down).
        norms = [m for m in module.modules()
                 if low is not None and isinstance(m, torch_private.BatchNormBase)]
        for norm in norms:
            shard_as(norm, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
        # A unit inside another must be sharded first: fully_shard on the outer one then leaves its
        # parameters to the inner one.
        for unit in reversed(units(module, cfg.fsdp_units, task)):
            if not any(unit is n for n in norms):
                shard_as(unit, mp_policy=policy)
        shard_as(module, mp_policy=policy)


def time_waits(model: torch.nn.Module, begin: Callable[[], None], end: Callable[[], None]) -> None:
    """Every training forward and backward of the FSDP `model` calls `begin()` before and `end()` after each
    place it waits for its peers, so the phase clock counts those waits as comm (trainapp/observe/timings.py).

    Forward: FSDP's own pre-forward (a forward pre-hook it prepends when it shards a unit) gathers the
    unit's parameters and waits for that all-gather; a hook prepended later runs before it, one appended
    runs after it. Backward: torch offers no hook there, so the units' parameter groups' `pre_backward`
    (the all-gather again, when parameters were resharded after forward, and the prefetch of the next
    unit's), `post_backward` (the reduce-scatter of the gradients) and `finalize_backward` (where CUDA
    streams wait for the last reduce-scatters) are wrapped; they are looked up on the group at every call.
    Those names are private (torch 2.14): where they are gone, one warning, and the backward's waits count
    as compute, as before. On CPU (gloo) each collective blocks the calling thread, so the clock's laps time
    it; on CUDA the laps are events on the compute stream, which FSDP makes wait for the collectives'
    streams inside these same calls: the stream's wait is timed, not the launch."""
    from torch.distributed.fsdp import FSDPModule

    def before(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if module.training:
            begin()

    def after(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if module.training:
            end()

    fsdp_units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in fsdp_units:
        unit.register_forward_pre_hook(before, prepend=True)
        unit.register_forward_pre_hook(after)
    groups = _param_groups(fsdp_units)
    if groups is None:
        log.warning("FSDP's parameter groups are not where trainapp looks for them in torch %s: the "
                    "backward's waits for peers count as compute in the rank timings", torch.__version__)
        return
    for group in groups:
        for name in _GROUP_WAITS:
            setattr(group, name, _bracketed(getattr(group, name), begin, end))


_GROUP_WAITS = ("pre_backward", "post_backward", "finalize_backward")
"""The methods of FSDP's (private) FSDPParamGroup within which a backward waits for the peers."""


def _param_groups(fsdp_units: Sequence[FSDPModule]) -> list[Any] | None:
    """Every unit's FSDP parameter groups, or None when this torch lays them out otherwise."""
    try:
        groups = [g for u in fsdp_units for g in torch_private.fsdp_param_groups(u)]
    except (AttributeError, TypeError):
        return None
    return groups if all(callable(getattr(g, n, None)) for g in groups for n in _GROUP_WAITS) else None


def _bracketed(method: Callable[..., Any], begin: Callable[[], None],
               end: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        begin()
        try:
            return method(*args, **kwargs)
        finally:
            end()

    return timed


def _padded(loader: DataLoader, ctx: DistContext) -> Iterator[tuple[bool, Any]]:
    """(padding, batch) pairs: this rank's validation batches, then as many more
    (padding=True, results dropped) as the rank with the most has: every forward of a sharded model is a
    collective of all ranks."""
    mine, last = 0, None  # counted: a stream's loader has no length
    for last in loader:
        mine += 1
        yield False, last
    extra = max(ctx.all_gather_objects(mine)) - mine
    if extra > 0:
        sample = getattr(loader.dataset, "sample_batch", None)  # a validation stream's (core/stream.py)
        pad = last if mine else sample() if sample else loader.collate_fn([loader.dataset[0]])
        for _ in range(extra):
            yield True, pad


def buffers_from_rank0(model: torch.nn.Module, ctx: DistContext) -> None:
    """Every rank, after each step under FSDP: rank 0's buffers (a BatchNorm's running statistics) on every
    rank, the values DDP's `broadcast_buffers` gives every rank at the next forward. FSDP shards
    parameters, not buffers, and without this each rank's statistics follow its own batches: what is
    evaluated, and what a snapshot holds (DCP saves one rank's copy of a tensor every rank has), would
    depend on the rank. One broadcast per dtype."""
    import torch.distributed as dist

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in model.buffers():
        by_dtype.setdefault(b.dtype, []).append(b)
    for bufs in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in bufs])
        dist.broadcast(flat, src=0)
        for b, part in zip(bufs, flat.split([b.numel() for b in bufs])):
            b.detach().copy_(part.view_as(b))
