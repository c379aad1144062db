"""How a global batch is cut into micro-batches (slots) and spread over the ranks, at any world size.

A global batch of G samples is S = G / b slots of b consecutive samples of the epoch's order
(b = `train.batch_size`). Slot k of a step is rank k % W's micro-batch number k // W. The slots do not
depend on W, so after a resize the same samples still meet in the same micro-batch (BatchNorm
normalises the same batch), and the random generators are seeded per (seed, step, slot) before each
micro-batch (dropout draws the same masks), whichever rank runs it. Every rank's loss is weighted
W / S, so DDP's mean over W ranks is the mean over S slots: a step's gradient is the same sum at every
world size, added in another order.

When S is not a multiple of W, the first S % W ranks run one micro-batch more: the math is unchanged,
and a step takes as long as the busiest rank's. More ranks than slots cannot all train: ConfigError.

`train.on_resize` says which global batch a resumed run has: `keep` (the snapshot's, or
`train.global_batch` when set) or `rescale` (batch_size * grad_accum * world size, with the peak
learning rate rescaled by `optim.lr_scaling`: the rule before this module existed).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from trainapp.config import ConfigError, TrainSection
from trainapp.core.state import derived_seed

log = logging.getLogger(__name__)


class Layout:
    """The global batch of this run and how rank `rank` of `world_size` takes part in it. Mutable in one
    place only: `resume`, when the snapshot's progress is loaded (before anything reads it)."""

    def __init__(self, train: TrainSection, world_size: int, rank: int, samples: int | None):
        self.train, self.world_size, self.rank, self.samples = train, world_size, rank, samples
        self.micro_batch = train.batch_size
        self.global_batch = train.global_batch or train.batch_size * train.grad_accum * world_size
        self.resized_from: dict[str, int] | None = None
        """The snapshot's world size and global batch, when this run resumed at another world size."""
        self._check(f"train.global_batch={train.global_batch}" if train.global_batch else
                    f"train.batch_size={train.batch_size}")

    @property
    def slots(self) -> int:
        return self.global_batch // self.micro_batch

    def micro_steps(self, rank: int | None = None) -> int:
        """Micro-batches rank `rank` (default: this one) runs per optimizer step."""
        return len(range(self.rank if rank is None else rank, self.slots, self.world_size))

    def slot(self, micro: int) -> int:
        """The slot this rank's micro-batch number `micro` of a step is."""
        return micro * self.world_size + self.rank

    @property
    def loss_weight(self) -> float:
        """What each micro-batch's loss is multiplied by, so DDP's mean over ranks is the mean over slots."""
        return self.world_size / self.slots

    @property
    def even(self) -> bool:
        return self.slots % self.world_size == 0

    def resume(self, saved_global_batch: int, saved_world_size: int) -> None:
        """The snapshot's progress is being loaded: under `keep` its global batch stays (unless
        `train.global_batch` says otherwise)."""
        if saved_world_size != self.world_size:
            self.resized_from = {"world_size": saved_world_size, "global_batch": saved_global_batch}
        if (self.train.on_resize == "keep" and not self.train.global_batch
                and saved_global_batch != self.global_batch):
            self.global_batch = saved_global_batch
            self._check("train.on_resize=keep")

    def _check(self, key: str) -> None:
        G, b, W = self.global_batch, self.micro_batch, self.world_size
        if G % b:
            raise ConfigError(f"{key}: the global batch {G} is not a whole number of micro-batches of "
                              f"train.batch_size={b}; set train.global_batch to a multiple of {b}, or "
                              "train.on_resize=rescale")
        if self.slots < W:
            raise ConfigError(f"{key}: the global batch {G} is {self.slots} micro-batch(es) of {b}, fewer "
                              f"than the {W} ranks; set train.global_batch to at least {b * W}, lower "
                              "train.batch_size, run on fewer workers, or set train.on_resize=rescale")
        if self.samples is not None and G > self.samples:  # a stream's length is not known
            raise ConfigError(f"{key}: the global batch {G} exceeds the {self.samples} training samples; "
                              "lower train.batch_size, train.grad_accum or train.global_batch")

    def line(self) -> str | None:
        """One line for the start of a run whose world size changed, or whose slots do not divide evenly."""
        if self.resized_from is None and self.even:
            return None
        G, S, W = self.global_batch, self.slots, self.world_size
        if self.resized_from is not None:
            was = self.resized_from
            how = ("kept" if G == was["global_batch"]
                   else f"{was['global_batch']} -> {G}, peak lr rescaled by "
                        "optim.lr_scaling (train.on_resize=rescale)")
            head = f"world size {was['world_size']} -> {W}: global batch {how}"
        else:
            head = f"global batch {G} over {W} ranks"
        if self.even:
            return f"{head}: {S // W} micro-batch(es) of {self.micro_batch} per rank"
        more = S % W
        return (f"{head}: {S} micro-batches of {self.micro_batch} do not split evenly over {W} ranks; ranks "
                f"0-{more - 1} run {S // W + 1}, the others {S // W}: the same math, each step as slow as "
                f"{S // W + 1} micro-batches")

    def to_dict(self) -> dict[str, Any]:
        """For the start record."""
        return {"global_batch": self.global_batch, "micro_batch": self.micro_batch, "slots": self.slots,
                "micro_steps": [self.micro_steps(r) for r in range(self.world_size)], "even": self.even,
                "on_resize": self.train.on_resize, "resized_from": self.resized_from}


def seed_slot(seed: int, step: int, slot: int) -> None:
    """Seed torch's (CPU and CUDA), numpy's and Python's generators for micro-batch `slot` of optimizer
    step `step`: what the model and loss draw (dropout, masks) follows the slot, not the rank."""
    s = derived_seed(seed, "step", step, slot)
    # Not torch.manual_seed: it also walks every other backend's generators, 80 µs a call here against 1 µs
    # for the CPU generator; CUDA's are seeded only once CUDA is in use (the same state as manual_seed's).
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(s)
