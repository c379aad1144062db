"""What is checked and counted whatever the strategy: SyncBatchNorm against an uneven split of the
global batch (before training), and the bytes of state each rank holds (at the end)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from trainapp.config import ConfigError

if TYPE_CHECKING:
    from trainapp.core.layout import Layout
    from trainapp.group import DistContext


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
