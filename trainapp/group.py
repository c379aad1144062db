"""A rank's view of its process group: who it is, on which device, and the few collectives the rest of
trainapp uses (each a no-op alone). A launcher makes it (trainapp/launch/dist.py); everything else
only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None
    owns_group: bool
    network: Any = None
    """The interface this process chose for NCCL/Gloo (trainapp.launch.net.Resolution), None when
    nothing was resolved."""
    store_scope: str = "side"
    """The prefix of this attempt of the group in its store, for word between ranks outside the group
    (trainapp/launch/dist.py's `side_store`)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place across ranks."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D `tensor` as the rows of one [world size, n] tensor, on every rank."""
        if not self.distributed:
            return tensor.unsqueeze(0)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor)
        return torch.stack(out)

    def all_gather_objects(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out
