"""How a task's datasets are read: per-item seeding, the resumable distributed sampler, the loaders,
and where training is in them (`Progress`).

Exact resume depends on the data order being a pure function of (seed, epoch, position): the sampler
draws one permutation per epoch and can start at any global sample offset, and random augmentations
are seeded per (seed, epoch, sample), so a run restarted mid-epoch sees what the uninterrupted run saw.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from trainapp.config import TrainSection
from trainapp.core.items import Items
from trainapp.core.loader_start import StartCheckedLoader
from trainapp.core.state import derived_seed

if TYPE_CHECKING:
    from trainapp.core.layout import Layout
    from trainapp.core.task import MapStyle

log = logging.getLogger(__name__)

class LocatedItems(Dataset):
    """A map-style set as the loaders read it: a batch of indices at a time (`__getitems__`, the set's own
    when it has one), handed to the collate as `Items` that know their indices, so that an item the collate
    cannot batch is named by its index (trainapp/core/items.py)."""

    def __init__(self, base: MapStyle, which: str):
        self.base, self.which = base, which

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Any:
        return self.base[i]

    def __getitems__(self, indices: list[int]) -> Any:
        got = self._read_many(indices)
        if not isinstance(got, list):  # the set's own batch type: the collate reads it as it is
            return got
        return Items(got, lambda k: f"item {indices[k]} of the {self.which} set")

    def _read_many(self, indices: list[int]) -> Any:
        many = getattr(self.base, "__getitems__", None)
        return many(indices) if callable(many) else [self[i] for i in indices]


class SeededItems(LocatedItems):
    """The task's training items, each read with the generators seeded from (seed, epoch, index).

    Random augmentations then depend only on which sample is read in which epoch, not on which
    DataLoader worker reads it or how far the process had got: a mid-epoch restart is exact. torch's
    generator is put back after each item (the model's dropout keeps the rank's stream); Python's and
    numpy's are left seeded from the last item, a pure function of the data position too (putting
    numpy's back costs more than reading a small item). A task whose items draw nothing random says
    so with `random_items = False`, and its items are read as they are (`LocatedItems`).
    """

    def __init__(self, base: MapStyle, seed: int):
        super().__init__(base, "train")
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, i: int) -> Any:
        return read_seeded(derived_seed(self.seed, self.epoch, i), self.base.__getitem__, i)

    def _read_many(self, indices: list[int]) -> Any:
        return [self[i] for i in indices]  # each seeded: not the set's own batch read


def draws_randomly(dataset: Any) -> bool:
    """Whether reading an item of `dataset` may draw random numbers: not for a list or a tuple of items, a
    TensorDataset, or a dataset (or stream) that says `random_items = False`. Items of one that does not are
    read without seeding (`SeededItems`): the generators' states travel in every snapshot anyway."""
    if type(dataset) in (list, tuple) or isinstance(dataset, TensorDataset):
        return False
    return getattr(dataset, "random_items", True) is not False


def read_seeded(seed: int, read: Callable[[Any], Any], key: Any) -> Any:
    """`read(key)` with torch's, Python's and numpy's generators seeded from `seed`, torch's put back after
    (`SeededItems`; a stream's items, trainapp/core/stream.py)."""
    gen = torch.default_generator
    saved = gen.get_state()
    gen.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    try:
        return read(key)
    finally:
        gen.set_state(saved)


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start an epoch at a global sample offset, and hands each rank the
    micro-batches (slots) of every global batch that `layout` (trainapp/core/layout.py) gives it.

    The epoch's permutation is DistributedSampler's (seeded by seed + epoch). A global batch is the next
    `layout.global_batch` indices of the permutation from `start`, cut into slots of
    `layout.micro_batch`; rank r takes slots r, r + W, ... of each, in that order, so a loader batching
    by `micro_batch` yields exactly its micro-batches. After k optimizer steps exactly the first
    start + k * global_batch indices are consumed, whatever the world size: a run resumed at another
    world size continues at the same global sample, and the same samples form the same micro-batches.
    Only whole global batches are handed out (the epoch's tail is dropped, as with drop_last).

    Without `layout` (evaluation) rank r takes every W-th index, so every index is visited exactly once,
    unpadded.
    """

    def __init__(self, dataset: MapStyle, num_replicas: int, rank: int, shuffle: bool, seed: int,
                 layout: Layout | None = None):
        # torch annotates a Dataset, and reads any map-style dataset (a length, items by index).
        super().__init__(dataset, num_replicas=num_replicas, rank=rank,  # type: ignore[arg-type]
                         shuffle=shuffle, seed=seed)
        self.layout, self.start = layout, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def steps_from(self, start: int) -> int:
        """Whole global batches (optimizer steps) in an epoch from global sample `start` on: the one
        place that says an epoch ends when less than a global batch is left."""
        if self.layout is None:
            raise ValueError("steps_from() is for training samplers (made with a layout)")
        # torch's Dataset declares no __len__ (torch's own samplers ignore this too): a sampler's is sized.
        return max(0, len(self.dataset) - start) // self.layout.global_batch  # type: ignore[arg-type]

    def steps_left(self) -> int:
        """Whole global batches left in this epoch from `start`."""
        return self.steps_from(self.start)

    def _order(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        if self.layout is None:
            return iter(order[self.rank::self.num_replicas])
        G, b, slots = self.layout.global_batch, self.layout.micro_batch, self.layout.slots
        mine = range(self.rank, slots, self.num_replicas)
        return (i for base in range(self.start, self.start + self.steps_left() * G, G)
                for k in mine for i in order[base + k * b: base + (k + 1) * b])

    def __len__(self) -> int:
        if self.layout is not None:
            return self.steps_left() * self.layout.micro_steps(self.rank) * self.layout.micro_batch
        return len(range(self.rank, len(self.dataset), self.num_replicas))  # type: ignore[arg-type]


def make_loader(dataset: MapStyle, sampler: ResumableDistributedSampler, batch_size: int, num_workers: int,
                pin_memory: bool, generator_seed: int, collate: Callable | None = None, *,
                start_s: float) -> DataLoader:
    # An explicit generator keeps DataLoader's worker base seed off the global torch RNG, whose
    # position differs between an uninterrupted run and one resumed mid-epoch.
    # torch annotates a Dataset, and reads any map-style dataset (a length, items by index).
    return StartCheckedLoader(
        dataset,
        batch_size=batch_size, sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
        drop_last=False, generator=torch.Generator().manual_seed(generator_seed),
        persistent_workers=False, collate_fn=collate, start_s=start_s,
    )


def set_epoch(dataset: MapStyle, sampler: ResumableDistributedSampler, epoch: int, start: int = 0) -> None:
    sampler.set_epoch(epoch, start)
    if isinstance(dataset, SeededItems):
        dataset.set_epoch(epoch)


class Batches(Protocol):
    """The training batches, epoch by epoch: EpochBatches, or a drill's stand-in for it
    (trainapp/faults/drills.py's slow batches)."""

    def steps_from(self, start: int) -> int: ...

    def epoch(self, epoch: int, start: int) -> Iterator[Any]: ...

    @property
    def account(self) -> dict[str, Any] | None:
        """What was read otherwise than straight (a stream's: trainapp/core/stream.py), for the end record's
        `data`; None for map-style data."""


class EpochBatches:
    """The training batches of an epoch from a global sample on: the sampler (and the augmentations) set
    to that position, and a fresh loader over it."""

    def __init__(self, dataset: MapStyle, sampler: ResumableDistributedSampler, batch_size: int,
                 num_workers: int, pin_memory: bool, seed: int, collate: Callable | None = None, *,
                 start_s: float):
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.num_workers, self.pin_memory, self.seed, self.collate = num_workers, pin_memory, seed, collate
        self.start_s = start_s

    account = None  # a map-style dataset is read as it is

    def steps_from(self, start: int) -> int:
        return self.sampler.steps_from(start)

    def epoch(self, epoch: int, start: int) -> Iterator[Any]:
        set_epoch(self.dataset, self.sampler, epoch, start)
        return iter(make_loader(self.dataset, self.sampler, self.batch_size, self.num_workers,
                                self.pin_memory, self.seed * 100_003 + epoch, self.collate,
                                start_s=self.start_s))


class Progress:
    """Where training is: optimizer steps done, the epoch and the global sample position in it, and
    the fp16 steps the GradScaler skipped (a device counter, so counting costs no host sync)."""

    def __init__(self, layout: Layout, device: torch.device):
        self.global_step, self.epoch, self.epoch_sample = 0, 0, 0
        self.layout = layout
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.resumed: dict[str, Any] | None = None
        """The progress of the snapshot this run resumed from (its world size and global batch too)."""

    @property
    def global_batch(self) -> int:
        return self.layout.global_batch

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "epoch": self.epoch, "epoch_sample": self.epoch_sample,
                "world_size": self.world_size, "global_batch": self.global_batch,
                "skipped_steps": int(self.skipped.item())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step, self.epoch, self.epoch_sample = (state["global_step"], state["epoch"],
                                                           state["epoch_sample"])
        self.skipped.fill_(state.get("skipped_steps", 0))
        self.resumed = dict(state)
        # Before the schedule reads the horizon.
        self.layout.resume(state["global_batch"], state["world_size"])

    def advance(self, steps_from: Callable[[int], int]) -> bool:
        """Count the step just taken; True when it was the epoch's last (`steps_from`: the sampler's)."""
        self.global_step += 1
        self.epoch_sample += self.global_batch
        if steps_from(self.epoch_sample) == 0:
            self.epoch, self.epoch_sample = self.epoch + 1, 0
            return True
        return False


def plan_total(sampler: ResumableDistributedSampler, progress: Progress, train: TrainSection) -> int:
    """Steps done plus steps left: the rest of this epoch and the full epochs after it."""
    left = 0
    if progress.epoch < train.epochs:
        left = (sampler.steps_from(progress.epoch_sample)
                + (train.epochs - progress.epoch - 1) * sampler.steps_from(0))
    total = progress.global_step + left
    return min(total, train.max_steps) if train.max_steps is not None else total
