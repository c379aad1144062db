"""How a loader worker reads a stream's lanes (trainapp/core/lanes.py) for trainapp/core/stream.py: each
lane's pieces opened, checked and read in turn, a micro-batch at a time, with retries of a failing shard.

Items are read with the generators seeded from (seed, epoch, shard, item), as map-style items are
(trainapp/core/data.py `SeededItems`), so a resumed run's augmentations are the straight run's; a stream
whose reads draw nothing random (tensor shards) is read unseeded and in bulk, and where the task batches
with the default collate a tensor shard serves a micro-batch whole (`take_batch`). A lane reopened after a
snapshot first re-reads the item before its position and compares its digest: a stream whose
`open(shard, start)` does not start at `start` is found at the first resume. A batch the collate cannot
make names the item (its shard and position, trainapp/core/items.py).
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any, Callable, Iterator, NamedTuple

from torch.utils.data import IterableDataset, get_worker_info

from trainapp.config import ConfigError
from trainapp.core.data import draws_randomly, read_seeded
from trainapp.core.items import Items, item_digest
from trainapp.core.lanes import Deal, Piece
from trainapp.core.state import derived_seed
from trainapp.errors import Failure, first_line

DOCS = "docs/your-own-model.md#9-streaming-data"


class ShardError(Failure):
    """A shard that could not be read after `data.shard_retries` retries (and was not to be skipped)."""

    cause = "data"


class Source:
    """The stream as one loader worker reads it: shards opened with retries, items read seeded."""

    def __init__(self, stream: Any, shards: list[Any], seed: int, random_items: bool, retries: int,
                 skip_bad: bool, batches: bool = False):
        self.stream, self.shards, self.seed = stream, shards, seed
        self.retries, self.skip_bad = retries, skip_bad
        self.random_items = random_items and draws_randomly(stream)
        """Whether items are read seeded: the task may draw random numbers in reading them, and so may the
        stream (tensor shards without a transform say they do not)."""
        self.batches = batches
        """Whether a micro-batch may be read whole where the opened shard can (`take_batch`, tensor shards):
        the task batches with torch's default collate, which that batch equals."""

    def read(self, it: Iterator[Any], piece: Piece, item: int, n: int) -> tuple[list[Any], Exception | None]:
        """Up to `n` next items of `it` (items `item`, ... of the piece's shard; fewer: the shard ended), and
        the error that stopped the read early, if one did (the items read before it are kept)."""
        got: list[Any] = []
        try:
            if not self.random_items:
                got.extend(itertools.islice(it, n))  # in C: no Python step per item
            else:
                seed, epoch, shard = self.seed, piece.epoch, piece.shard
                for j in range(item, item + n):
                    got.append(read_seeded(derived_seed(seed, epoch, "shard", shard, j), next, it))
        except StopIteration:
            pass
        except Exception as e:  # the user's reader: a failed read of this shard
            return got, e
        return got, None

    def open(self, piece: Piece, item: int, check: str | None) -> Iterator[Any]:
        """The piece's shard from `item` on; with `check`, the item before it is re-read first and must
        have that digest (ConfigError otherwise: the stream's `open` did not start where asked)."""
        shard = self.shards[piece.shard]
        if check is None or item == 0:
            return iter(self.stream.open(shard, item))
        it = iter(self.stream.open(shard, item - 1))
        got, error = self.read(it, piece, item - 1, 1)
        if error is not None:
            raise error
        before = item_digest(got[0]) if got else "(the shard ended before it)"
        if before != check:
            raise ConfigError(f"the train stream's open({shard!r}, {item - 1}) gave an item other than item "
                              f"{item - 1} of a read from the start: open(shard, start) must start at item "
                              f"`start` and give the same items every time ({DOCS})")
        return it


class Batch(NamedTuple):
    """A micro-batch read whole from a stream (`take_batch`): already what the collate would make."""

    batch: Any


def _where(shards: list[Any], runs: list[tuple[int, int, int]], k: int) -> str:
    """Where item k of a micro-batch read in `runs` (shard, first item, items) came from."""
    for shard, first, count in runs:
        if k < count:
            return f"item {first + k} of the train stream's shard {shards[shard]!r}"
        k -= count
    return f"item {k} past the micro-batch's end"


class Lane:
    """One lane's reader in a loader worker: its pieces, and how far it has read."""

    def __init__(self, source: Source, pieces: list[Piece], pos: list[Any]):
        self.source, self.pieces = source, pieces
        self.index, self.item, self.check = pos
        self.it: Iterator[Any] | None = None
        self.failures = 0

    def take(self, n: int) -> tuple[Items | Batch, list[str], list[int]]:
        """Up to `n` next items (fewer: the lane ran dry) that know where they came from, or the micro-batch
        read whole; the shards skipped on the way, and the indices of the pieces the items came from."""
        items: list[Any] = []
        runs: list[tuple[int, int, int]] = []  # (shard, first item, items) of each piece read
        skipped: list[str] = []
        touched: list[int] = []
        while len(items) < n and self.index < len(self.pieces):
            piece, want = self.pieces[self.index], n - len(items)
            opened, whole = self._begin(piece, n if want == n else 0, skipped)
            if whole is not None:
                return whole, skipped, [self.index]
            if not opened or self.it is None:
                continue
            got, error = self.source.read(self.it, piece, self.item, want)
            if got:
                items += got
                runs.append((piece.shard, self.item, len(got)))
                self.item, self.check, self.failures = self.item + len(got), None, 0
                touched += [] if touched and touched[-1] == self.index else [self.index]
            if isinstance(error, ConfigError):
                raise error
            if error is not None:
                self._failed(piece, error, skipped)
            elif len(got) < want:  # the shard ended
                self._next_piece()
        if items:
            self.check = item_digest(items[-1])
        return Items(items, functools.partial(_where, self.source.shards, runs)), skipped, touched

    def _begin(self, piece: Piece, whole: int, skipped: list[str]) -> tuple[bool, Batch | None]:
        """The piece opened where it is not (False: it failed), and with `whole` the next micro-batch of that
        many items read whole where the shard can."""
        try:
            if self.it is None:
                self.it = self.source.open(piece, self.item, self.check)
            return True, self._whole(whole) if whole else None
        except ConfigError:
            raise
        except Exception as e:  # the user's reader: any error is a failed read of this shard
            self._failed(piece, e, skipped)
            return False, None

    def _whole(self, n: int) -> Batch | None:
        """The next micro-batch as one read of the opened shard (tensor shards), or None."""
        take = getattr(self.it, "take_batch", None) if self.source.batches else None
        got = take(n) if take is not None else None
        if got is None:
            return None
        batch, last = got
        self.item, self.check, self.failures = self.item + n, item_digest(last), 0
        return Batch(batch)

    def _failed(self, piece: Piece, e: Exception, skipped: list[str]) -> None:
        """A failed open or read of `piece`: retried after a pause (reopened at the item reached), then
        ShardError, or the rest of the shard skipped (`data.skip_bad_shards`, noted in `skipped`)."""
        self.it = None
        self.failures += 1
        if self.failures <= self.source.retries:
            time.sleep(min(0.5 * 2 ** (self.failures - 1), 5.0))
            return
        shard = self.source.shards[piece.shard]
        what = f"shard {shard!r} failed {self.failures} time(s) at item {self.item} ({first_line(e)})"
        if not self.source.skip_bad:
            raise ShardError(f"{what}; data.shard_retries={self.source.retries} retries spent; set "
                             "data.skip_bad_shards=true to go on without the rest of such a shard")
        skipped.append(what)
        self._next_piece()

    def _next_piece(self) -> None:
        self.index, self.it, self.failures = self.index + 1, None, 0
        if self.index < len(self.pieces):
            self.item, self.check = self.pieces[self.index].start, self.pieces[self.index].check

    def pos(self) -> list[Any]:
        return [self.index, self.item, self.check]


class LaneReader(IterableDataset):
    """This rank's lanes as a loader's dataset. Slot `slots[m]` of step t reads lane
    slots[m] * k + t % k (k lanes per slot, one per loader worker); the rank's micro-batches are numbered
    p = (t - t0) * M + m from the first step read (t0), and worker p % n makes micro-batch p, as
    DataLoader's round-robin over its n workers expects. With k = n each lane is read by one worker only.
    One entry per micro-batch: ("ok", lane, batch, position after, skipped shards), ("dry", lane, the
    pieces that still held items) or
    ("failed", lane, error); a worker ends after the step in which one of its lanes ran dry."""

    def __init__(self, source: Source, deal: Deal, slots: list[int], per_slot: int, first_step: int,
                 micro_batch: int, collate: Callable[[list[Any]], Any]):
        self.source, self.deal, self.slots, self.per_slot = source, deal, slots, per_slot
        self.first_step, self.micro_batch, self.collate = first_step, micro_batch, collate

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        k, M, t = self.per_slot, len(self.slots), self.first_step
        readers: dict[int, Lane] = {}
        while True:
            ended = False
            for m, slot in enumerate(self.slots):
                if ((t - self.first_step) * M + m) % n != w:
                    continue
                lane = slot * k + t % k
                if lane not in readers:
                    readers[lane] = Lane(self.source, self.deal.lanes[lane], self.deal.pos[lane])
                try:
                    items, skipped, touched = readers[lane].take(self.micro_batch)
                    batch = (items.batch if isinstance(items, Batch) else
                             self.collate(items) if len(items) == self.micro_batch else None)
                except (ConfigError, ShardError) as e:  # a bad shard, or an item the collate cannot batch
                    yield ("failed", lane, e)
                    return
                if batch is None:
                    yield ("dry", lane, touched)
                    ended = True
                else:
                    yield ("ok", lane, batch, readers[lane].pos(), skipped)
            if ended:
                return
            t += 1


class ValReader(IterableDataset):
    """A validation stream: rank r of W reads shards r, r + W, ... whole (a loader worker every n-th of
    them), in batches of `batch_size`."""

    def __init__(self, stream: Any, shards: list[Any], rank: int, world_size: int, batch_size: int,
                 collate: Callable[[list[Any]], Any]):
        self.stream, self.shards, self.mine = stream, shards, shards[rank::world_size]
        self.batch_size, self.collate = batch_size, collate

    def sample_batch(self) -> Any:
        """A batch of the stream's first item: what a rank without validation batches runs when a sharded
        model's forwards must be run by every rank."""
        return self.collate(Items([next(iter(self.stream.open(self.shards[0], 0)))],
                                  lambda k: f"item 0 of the val stream's shard {self.shards[0]!r}"))

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        items: list[Any] = []
        places: list[tuple[Any, int]] = []
        for shard in self.mine[w::n]:
            for i, item in enumerate(self.stream.open(shard, 0)):
                items.append(item)
                places.append((shard, i))
                if len(items) == self.batch_size:
                    yield self._batch(items, places)
                    items, places = [], []
        if items:
            yield self._batch(items, places)

    def _batch(self, items: list[Any], places: list[tuple[Any, int]]) -> Any:
        return self.collate(Items(items, lambda k: f"item {places[k][1]} of the val stream's shard "
                                                   f"{places[k][0]!r}"))


def keep(entry: Any) -> Any:
    return entry
