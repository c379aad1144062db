"""Where a stream is read (trainapp/streams/): its shards dealt to lanes, and each lane's position.

A lane is a slot of the global batch (trainapp/core/layout.py): slot k of every step takes the next
`train.batch_size` items of lane k, whichever rank runs the slot. An epoch's shards, in an order seeded
by (seed, epoch), are dealt round-robin to the S lanes; each lane reads its pieces one after the other.
A step therefore holds the same items at every world size (the lanes do not depend on it), and a
resized run that keeps its global batch trains the same micro-batches as its straight twin.

A piece is a shard read from an item on: (the epoch it belongs to, shard index, first item, digest of
the item before it). When the number of lanes changes (`train.on_resize=rescale`), the unread
remainder of every lane is dealt to the new lanes; when an epoch ends (a lane ran dry), the unread
remainder of every lane is dealt first in the next epoch. Either way every item of an epoch is read
exactly once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from trainapp.core.state import derived_seed

class Piece(NamedTuple):
    """A shard read from an item on."""

    epoch: int
    """The epoch the piece's items belong to (a piece carried into the next epoch keeps it)."""
    shard: int
    """The shard's index in the stream's `shards()`."""
    start: int
    """The first item to read."""
    check: str | None
    """The digest of the item before `start` (core/lane_reader.py re-reads it to check `open`), or None."""


def shard_order(seed: int, epoch: int, n_shards: int) -> list[int]:
    """The epoch's shard order, the same on every rank and in every run with `seed`."""
    order = list(range(n_shards))
    random.Random(derived_seed(seed, "shards", epoch)).shuffle(order)
    return order


@dataclass
class Deal:
    """An epoch's lanes: `lanes[k]` the pieces lane k reads in order; `pos[k]` = [piece index, next item
    of that piece's shard, digest of the item before it]: what the steps done so far consumed."""

    epoch: int
    lanes: list[list[Piece]]
    pos: list[list[Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.pos:
            self.pos = [[0, lane[0][2], lane[0][3]] if lane else [0, 0, None] for lane in self.lanes]

    @property
    def slots(self) -> int:
        return len(self.lanes)

    @classmethod
    def first(cls, seed: int, epoch: int, n_shards: int, slots: int, carry: Sequence[Piece] = ()) -> Deal:
        """Epoch `epoch`'s deal: what the last epoch left (`carry`) first, then its own shards."""
        pieces = [*carry, *(Piece(epoch, s, 0, None) for s in shard_order(seed, epoch, n_shards))]
        return cls(epoch, _deal(pieces, slots))

    def remainder(self, dry: dict[int, list[int]] | None = None) -> list[Piece]:
        """The unread pieces, lane by lane: each lane's current piece from its position, then the rest. For a
        lane in `dry` (lane -> the indices of the pieces that still held items when it ran dry), only those:
        the pieces it found empty are left out."""
        out: list[Piece] = []
        for k, (lane, (index, item, check)) in enumerate(zip(self.lanes, self.pos)):
            held = set(dry[k]) if dry and k in dry else None
            if index < len(lane) and (held is None or index in held):
                out.append(Piece(lane[index].epoch, lane[index].shard, item, check))
            out.extend(p for j, p in enumerate(lane[index + 1:], index + 1) if held is None or j in held)
        return out

    def redeal(self, slots: int) -> Deal:
        """The same epoch over `slots` lanes: the remainder dealt round-robin."""
        return Deal(self.epoch, _deal(self.remainder(), slots))

    def next_epoch(self, seed: int, n_shards: int, dry: dict[int, list[int]] | None = None) -> Deal:
        return Deal.first(seed, self.epoch + 1, n_shards, self.slots, self.remainder(dry))

    def merge(self, positions: dict[int, list[Any]]) -> None:
        """Lane positions known to other ranks (lane -> pos) into this deal."""
        for lane, pos in positions.items():
            self.pos[lane] = list(pos)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "lanes": [[list(p) for p in lane] for lane in self.lanes],
                "pos": [list(p) for p in self.pos]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Deal:
        lanes = [[Piece(int(e), int(s), int(i), c) for e, s, i, c in lane] for lane in state["lanes"]]
        return cls(int(state["epoch"]), lanes, [list(p) for p in state["pos"]])


def _deal(pieces: list[Piece], slots: int) -> list[list[Piece]]:
    return [list(pieces[k::slots]) for k in range(slots)]
