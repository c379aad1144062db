"""How the model is spread over the ranks (`parallel.strategy`).

- `ddp`: every rank holds the whole model; DistributedDataParallel all-reduces the gradients. The
  snapshot goes into the plain module before it is wrapped (trainapp/core/build.py).
- `fsdp`: FSDP2's `fully_shard` on the units (`parallel.fsdp_units`, the task's `shard_units`, or
  every child of the model that holds parameters), then on the model itself: each rank keeps a shard
  of every parameter, its gradient and its optimizer state; a unit gathers its parameters for its own
  forward and backward. Autocast over fp32 parameters, as under DDP, or parameters gathered in
  autocast's dtype (`parallel.fsdp_param_dtype=amp`, BatchNorm units kept fp32). The optimizer is made
  over the sharded parameters, so after the wrap, and the snapshot is loaded into the sharded state
  (trainapp/core/state.py's `ShardedState`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainapp.config import Config, ConfigError
from trainapp.core import torch_private

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.utils.data import DataLoader

    from trainapp.core.layout import Layout
    from trainapp.group import DistContext

log = logging.getLogger(__name__)


def wrap_ddp(model: torch.nn.Module, ctx: DistContext) -> DDP | None:
    """The DDP wrapper when distributed (None alone)."""
    if not ctx.distributed:
        return None
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               gradient_as_bucket_view=True)


def check_sync_bn(model: torch.nn.Module, layout: Layout, requested: bool) -> None:
    """ConfigError when SyncBatchNorm would meet a global batch that does not split evenly over the ranks.

    SyncBatchNorm runs a collective in every forward and backward of a training micro-batch; the ranks
    with one micro-batch more (trainapp/core/layout.py) would issue collectives the others never join,
    which NCCL pairs with the next collective: a hang, or statistics from the wrong tensors, and the
    hang watch would restart into the same split. `requested`: `model.sync_bn` of the image task, which
    converts only on GPUs: refused on CPU too, so a laptop run fails as the cluster would."""
    if layout.world_size < 2 or layout.even:
        return
    names = [n for n, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if not names and not requested:
        return
    what = "model.sync_bn=true" if requested else f"the model's SyncBatchNorm layers ({names[0]}, ...)"
    G, b, W = layout.global_batch, layout.micro_batch, layout.world_size
    at = (f" (resumed at world size {W} from {layout.resized_from['world_size']}, train.on_resize=keep)"
          if layout.resized_from else "")
    raise ConfigError(f"{what}: the global batch {G} is {layout.slots} micro-batches of {b}, which do not "
                      f"split evenly over {W} ranks{at}; SyncBatchNorm needs every rank in every forward and "
                      f"backward, so the ranks would hang; set train.global_batch to a multiple of {b * W}, "
                      "or " + ("model.sync_bn=false" if requested
                               else "convert the SyncBatchNorm layers to BatchNorm"))


def units(model: torch.nn.Module, names: list[str], task: Any = None) -> list[torch.nn.Module]:
    """The modules sharded as units, outermost first: by class name (`parallel.fsdp_units`), else the
    task's `shard_units(model)`, else every child of the model that holds parameters, the items of a
    Sequential or ModuleList child each a unit of its own (a transformer's blocks)."""
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        missing = sorted(set(names) - {type(m).__name__ for m in found})
        if missing:
            have = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(f"parallel.fsdp_units={names}: no module of class {', '.join(missing)} in the "
                              f"model; its module classes are {', '.join(have)}")
        return found
    chosen = task.shard_units(model) if task is not None and hasattr(task, "shard_units") else None
    if chosen is not None:
        return chosen
    # A parameter tied to another module's (an embedding shared with the output layer) must stay in one
    # FSDP group: a unit holding one is left to the model's own group.
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    out: list[torch.nn.Module] = []
    for child in model.children():
        items = (list(child.children()) if isinstance(child, (torch.nn.Sequential, torch.nn.ModuleList))
                 else [child])
        out.extend(m for m in items if any(True for _ in m.parameters())
                   and all(counts[id(p)] == 1 for p in m.parameters()))
    return out


def shard(model: torch.nn.Module, cfg: Config, task: Any = None, copy: torch.nn.Module | None = None,
          dtype: torch.dtype | None = None) -> None:
    """`fully_shard` on the units, innermost first, then on the model; the same on `copy` (the EMA copy
    of the model), whose shards then lie beside the model's. Parameters gathered in fp32, or in `dtype`
    (autocast's) with `parallel.fsdp_param_dtype=amp`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = dtype if cfg.parallel.fsdp_param_dtype == "amp" else None
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    shard_as = functools.partial(fully_shard, reshard_after_forward=cfg.parallel.reshard_after_forward)
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
        for unit in reversed(units(module, cfg.parallel.fsdp_units, task)):
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


def no_sync(train_model: torch.nn.Module, ddp: DDP | None, sharded: bool,
            sync: bool) -> contextlib.AbstractContextManager[None]:
    """The context of one micro-batch's backward: gradients reduced across ranks only when `sync` (the
    last micro-batch of the step). DDP's `no_sync`, FSDP's `set_requires_gradient_sync`."""
    if sharded:
        cast("FSDPModule", train_model).set_requires_gradient_sync(sync)  # fully_shard made it one
    elif ddp is not None and not sync:
        return ddp.no_sync()
    return contextlib.nullcontext()


def eval_batches(loader: DataLoader, ctx: DistContext, sharded: bool) -> Iterator[tuple[bool, Any]]:
    """(padding, batch) pairs: this rank's validation batches, then, for a sharded model, as many more
    (padding=True, results dropped) as the rank with the most has: every forward of a sharded model is a
    collective of all ranks."""
    yield from ((False, b) for b in loader)
    if not sharded:
        return
    mine = len(loader)
    extra = max(ctx.all_gather_objects(mine)) - mine
    if extra > 0:
        pad = loader.collate_fn([loader.dataset[0]])
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


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                ctx: DistContext) -> list[dict[str, int]] | None:
    """Every rank calls this; rank 0 gets per rank the bytes of its parameters, their gradients (one per
    parameter, as every backward allocates them) and its optimizer state: what `parallel.strategy`
    spreads. None elsewhere."""
    params = sum(_local_bytes(p) for p in model.parameters())
    optim = sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    mine = {"params": params, "grads": params, "optimizer": optim, "total": 2 * params + optim}
    return ctx.gather_objects(mine)
