"""A rank's view of its process group: who it is, on which device, and the few collectives the rest of
trainapp uses (each a no-op alone). A launcher makes it (trainapp/launch/dist.py); everything else
only reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any, Iterator, TypeVar, cast

import torch
import torch.distributed as dist

from trainapp.errors import Failure

T = TypeVar("T")


class WaitTimeout(Failure):
    """A rank waited `dist.timeout_s` for another rank's work outside the process group (rank 0's disk)."""

    cause = "timeout"


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
    device_why: str = ""
    """Why the rank trains on `device` (`dist.device` and what the launcher allotted), for the start
    record."""
    side: dist.ProcessGroup | None = None
    """A Gloo group of every rank with `dist.timeout_s`, for waits on rank 0's file work (`files`)."""
    group: dist.ProcessGroup | None = None
    """The group this context's collectives run on (None: the default group; `files`: the side group)."""
    timeout_s: float = 1800.0
    """`dist.timeout_s`: what every group this context makes waits at most."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    waits_for: str = ""
    """What this context's collectives wait for, when a timeout there has a cause to name (`files`)."""

    @property
    def files(self) -> DistContext:
        """The same rank, whose collectives run on the Gloo side group: for every wait on rank 0's file
        work (a snapshot written, the newest snapshot found, the lease read, a dataset downloaded). On
        NCCL a wait past `dist.timeout_s` is torn down by NCCL's watchdog from C++, with no failure
        record and no line; on Gloo it raises where trainapp records it. Object collectives on a Gloo
        group also stay on the CPU (no pickled bytes copied to the GPU and back)."""
        return self.on_side("rank 0's file work (a snapshot written, the newest one found, the lease, a "
                            "download)")

    def on_side(self, waits_for: str) -> DistContext:
        """The same rank, whose collectives run on the Gloo side group (CPU tensors), a timeout there said as
        a wait for `waits_for`; this context itself where there is no side group (alone)."""
        if self.side is None:
            return self
        return dataclasses.replace(self, side=None, group=self.side, waits_for=waits_for)

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """A Gloo timeout while waiting for `waits_for`, said as what it is (the disk), not Gloo's words."""
        try:
            yield
        except RuntimeError as e:
            if not self.waits_for or "timed out" not in str(e).lower():
                raise
            raise WaitTimeout(f"waited dist.timeout_s={self.timeout_s:g} s for {self.waits_for}: its storage "
                              "is slow or stuck; raise dist.timeout_s if it is this slow") from None

    def new_side_group(self) -> dist.ProcessGroup:
        """Another Gloo group of every rank with `dist.timeout_s` (torch gives a new group 30 minutes), for
        collectives of a thread of their own (the stop vote, the snapshot agreement). Every rank at once."""
        # Every rank is a member (no `ranks`), so never torch's non-member sentinel.
        return cast(dist.ProcessGroup,
                    dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)))

    def barrier(self) -> None:
        if self.distributed:
            with self._waiting():
                dist.barrier(group=self.group)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place across ranks."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D `tensor` as the rows of one [world size, n] tensor, on every rank."""
        if not self.distributed:
            return tensor.unsqueeze(0)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.group)
        return torch.stack(out)

    def all_gather_objects(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._waiting():
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        with self._waiting():
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather_objects(self, obj: T) -> list[T] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        with self._waiting():
            dist.gather_object(obj, out, dst=0, group=self.group)
        return out
