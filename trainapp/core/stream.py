"""A stream's batches (trainapp/streams/): the lanes of trainapp/core/lanes.py read by this rank's
loader, the position the steps consumed, and the epoch's end agreed by every rank.

Rank r runs slots r, r + W, ... of each step (trainapp/core/layout.py), so it reads those lanes. A
loader worker serves every n-th of the rank's lanes (n divides the rank's micro-batches per step, so
DataLoader's round-robin over workers gives the micro-batches in slot order) and yields each
micro-batch with the lane's position after it; the position becomes the run's only when a step
consumes the micro-batch. Before each step every rank reads its micro-batches ahead, and one
all-reduce says whether all ranks have theirs: when a lane runs dry the epoch ends on every rank at
the same step, and what the other lanes had not read is dealt first in the next epoch.

Items are read with the generators seeded from (seed, epoch, shard, item), as map-style items are
(trainapp/core/data.py `SeededItems`), so a resumed run's augmentations are the straight run's.
A lane reopened after a snapshot first re-reads the item before its position and compares its
digest: a stream whose `open(shard, start)` does not start at `start` is found at the first resume.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import logging
import pickle
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainapp.config import ConfigError
from trainapp.core.data import draws_randomly, read_seeded
from trainapp.core.items import DefaultCollate, Items, item_digest
from trainapp.core.lanes import Deal, Piece
from trainapp.core.state import derived_seed
from trainapp.errors import Failure, first_line

if TYPE_CHECKING:
    from trainapp.config import Config
    from trainapp.core.data import Progress
    from trainapp.core.task import BoundTask
    from trainapp.group import DistContext

log = logging.getLogger(__name__)

DOCS = "docs/your-own-model.md#9-streaming-data"


class ShardError(Failure):
    """A shard that could not be read after `data.shard_retries` retries (and was not to be skipped)."""

    cause = "data"


def shards_digest(shards: list[Any]) -> str:
    return hashlib.blake2b(repr(shards).encode(), digest_size=8).hexdigest()


class _Source:
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


class _Lane:
    """One lane's reader in a loader worker: its pieces, and how far it has read."""

    def __init__(self, source: _Source, pieces: list[Piece], pos: list[Any]):
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

    def __init__(self, source: _Source, deal: Deal, slots: list[int], per_slot: int, first_step: int,
                 micro_batch: int, collate: Callable[[list[Any]], Any]):
        self.source, self.deal, self.slots, self.per_slot = source, deal, slots, per_slot
        self.first_step, self.micro_batch, self.collate = first_step, micro_batch, collate

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        k, M, t = self.per_slot, len(self.slots), self.first_step
        readers: dict[int, _Lane] = {}
        while True:
            ended = False
            for m, slot in enumerate(self.slots):
                if ((t - self.first_step) * M + m) % n != w:
                    continue
                lane = slot * k + t % k
                if lane not in readers:
                    readers[lane] = _Lane(self.source, self.deal.lanes[lane], self.deal.pos[lane])
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


def val_loader(stream: Any, shards: list[Any], ctx: DistContext, batch_size: int, num_workers: int,
               pin_memory: bool, collate: Callable[[list[Any]], Any]) -> DataLoader:
    reader = ValReader(stream, shards, ctx.rank, ctx.world_size, batch_size, collate)
    workers = min(num_workers, len(reader.mine))
    return DataLoader(reader, batch_size=None, num_workers=workers, pin_memory=pin_memory)


def _keep(entry: Any) -> Any:
    return entry


def listed(name: str, which: str, stream: Any) -> list[Any]:
    """The stream's shards, listed once (a listing may ask object storage), checked: a non-empty list of
    picklable descriptors."""
    shards = stream.shards()
    if not isinstance(shards, (list, tuple)) or not shards:
        raise ConfigError(f"task.name={name!r}: the {which} stream's shards() returned "
                          f"{type(shards).__name__} {repr(shards)[:60]}; it must return a non-empty list of "
                          "shard descriptors (paths, URLs, indices)")
    try:
        pickle.dumps(list(shards))
    except Exception as e:
        raise ConfigError(f"task.name={name!r}: the {which} stream's shards cannot be pickled "
                          f"({first_line(e)}); describe each shard by a path, URL or number") from None
    return list(shards)


class StreamBatches:
    """The training batches of a stream, epoch by epoch (the `Batches` of trainapp/core/data.py), and
    the stream's position as a part of the run's state (`stream` in a snapshot: the epoch's deal and
    every lane's position, gathered from the ranks that read them)."""

    collective = True

    def __init__(self, stream: Any, shards: list[Any], progress: Progress, ctx: DistContext, cfg: Config,
                 task: BoundTask):
        self.stream, self.shards, self.seed = stream, shards, cfg.seed
        self.digest = shards_digest(shards)
        # Its collectives (a flag per step, positions at a snapshot or an epoch's end) on the Gloo side group,
        # in CPU tensors: no device sync in the step, and a wait past dist.timeout_s is said by name.
        self.ctx = ctx.on_side("the other ranks' next micro-batches of the train stream")
        if len(set(self.ctx.all_gather_objects(self.digest))) > 1:
            raise ConfigError(f"task.name={task.name!r}: the train stream's shards() differ between ranks; "
                              "list the same shards in the same order on every rank (sort them)")
        self.progress, self.layout = progress, progress.layout  # the step a reader starts at picks each lane
        self.collate, self.num_workers, self.epochs = task.collate, cfg.data.num_workers, cfg.train.epochs
        self.pin_memory = ctx.device.type == "cuda"
        self.source = _Source(stream, shards, cfg.seed, task.random_items, cfg.data.shard_retries,
                              cfg.data.skip_bad_shards, batches=isinstance(task.collate, DefaultCollate))
        self.deal: Deal | None = None
        self._entries: Iterator[Any] | None = None
        self._ahead: collections.deque[Any] = collections.deque()
        self.account: dict[str, Any] = {"carried_pieces": 0, "dropped_pieces": 0, "skipped_shards": 0,
                                        "resized": 0}
        """What the stream did that the straight reading of its shards would not: pieces carried into a
        next epoch, dropped after the last, shards skipped (`data.skip_bad_shards`), re-deals."""

    @property
    def per_slot(self) -> int:
        """Lanes per slot: one per loader worker (`data.num_workers`, or 1 in the training process), so
        that every worker reads lanes of its own."""
        return max(1, self.num_workers)

    @property
    def lanes(self) -> int:
        return self.layout.slots * self.per_slot

    def _slots(self) -> list[int]:
        return [self.layout.slot(m) for m in range(self.layout.micro_steps())]

    def _mine(self) -> list[int]:
        """This rank's lanes: every lane of its slots."""
        return [slot * self.per_slot + j for slot in self._slots() for j in range(self.per_slot)]

    def epoch(self, epoch: int, start: int) -> Iterator[Any]:
        if self._entries is not None and self.deal is not None and self.deal.epoch == epoch:
            return self  # opened by `settle`, its first step read
        self._open(epoch)
        if not self._ready():
            raise ConfigError(f"the train stream's epoch {epoch} cannot fill one step: a lane of the global "
                              f"batch has fewer than train.batch_size={self.layout.micro_batch} items; give "
                              f"the stream at least {self.lanes} shards of at least that many items ({DOCS})")
        return self

    def settle(self, progress: Any) -> None:
        """Every rank, after a resume: open the resumed epoch and read its next step. When what is left of it
        cannot fill one (re-dealt to more lanes than it has pieces, near its end), the epoch ends there:
        `progress` moves on to the next, its rest carried into it as at any epoch's end."""
        self._open(progress.epoch)
        while not self._ready():
            self._end_epoch()
            progress.epoch, progress.epoch_sample = progress.epoch + 1, 0
            if progress.epoch >= self.epochs:
                return
            self.epoch(progress.epoch, 0)

    def _open(self, epoch: int) -> None:
        if self.deal is None:
            self.deal = Deal.first(self.seed, epoch, len(self.shards), self.lanes)
        if self.deal.epoch != epoch:
            raise ValueError(f"the stream's position is in epoch {self.deal.epoch}, the run's in {epoch}")
        if self.deal.slots != self.lanes:
            if self.ctx.is_main:
                log.info("stream: the unread rest of epoch %d's %d lanes dealt to %d", epoch, self.deal.slots,
                         self.lanes)
            self.deal = self.deal.redeal(self.lanes)
            self.account["resized"] += 1
        reader = LaneReader(self.source, self.deal, self._slots(), self.per_slot, self.progress.global_step,
                            self.layout.micro_batch, self.collate)
        loader = DataLoader(reader, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                            collate_fn=_keep,
                            generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
        self._entries, self._ahead = iter(loader), collections.deque()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        _, lane, batch, pos, skipped = self._ahead.popleft()
        assert self.deal is not None
        self.deal.pos[lane] = list(pos)
        for what in skipped:
            self.account["skipped_shards"] += 1
            log.warning("stream: skipped the rest of a shard (data.skip_bad_shards): %s", what)
        return batch

    def steps_from(self, start: int) -> int:
        """After a step: 1 when every rank has its micro-batches of the next, else 0 (the epoch ended on
        every rank; its unread rest is dealt first in the next). A collective of every rank."""
        if self._ready():
            return 1
        self._end_epoch()
        return 0

    def _ready(self) -> bool:
        """Every rank: whether every rank read its micro-batches of the next step (a failed read ends
        every rank: its own error here, a ShardError naming the rank elsewhere)."""
        assert self._entries is not None
        while len(self._ahead) < len(self._slots()):
            try:
                self._ahead.append(next(self._entries))
            except StopIteration:
                self._ahead.append(("dry", -1, []))
        kinds = {e[0] for e in self._ahead}
        flags = torch.tensor([float("dry" in kinds), float("failed" in kinds)])
        dry, failed = self.ctx.all_reduce_sum(flags).tolist()
        if failed:
            mine = [e for e in self._ahead if e[0] == "failed"]
            if mine:
                raise mine[0][2]
            raise ShardError("another rank could not read its shards of the train stream (its failure record "
                             "names the shard)")
        return not dry

    def _end_epoch(self) -> None:
        assert self.deal is not None
        mine = {"pos": {k: self.deal.pos[k] for k in self._mine()},
                "dry": {e[1]: e[2] for e in self._ahead if e[0] == "dry" and e[1] >= 0}}
        self._entries, self._ahead = None, collections.deque()
        dry: dict[int, list[int]] = {}
        for theirs in self.ctx.all_gather_objects(mine):
            self.deal.merge(theirs["pos"])
            dry.update(theirs["dry"])
        rest = self.deal.remainder(dry)
        last = self.deal.epoch + 1 >= self.epochs
        self.account["dropped_pieces" if last else "carried_pieces"] += len(rest)
        if rest and self.ctx.is_main:
            log.info("stream: epoch %d ended with %d unread piece(s) of shards: %s", self.deal.epoch,
                     len(rest),
                     "dropped (the last epoch)" if last else "read first in the next epoch")
        self.deal = self.deal.next_epoch(self.seed, len(self.shards), dry)

    def state_dict(self) -> dict[str, Any] | None:
        assert self.deal is not None
        gathered = self.ctx.gather_objects({k: self.deal.pos[k] for k in self._mine()})
        if gathered is None:
            return None
        state = self.deal.state_dict()  # copies: the lanes read on by their ranks after this
        for lanes in gathered:
            for lane, pos in lanes.items():
                state["pos"][lane] = list(pos)
        return {**state, "shards": len(self.shards), "shards_digest": self.digest,
                "account": dict(self.account)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["shards"] != len(self.shards) or state["shards_digest"] != self.digest:
            raise ValueError(f"the train stream's shards() differ from the snapshot's ({state['shards']} "
                             f"then, {len(self.shards)} now, or another order)")
        self.deal = Deal.from_state(state)
        self.account.update(state.get("account", {}))


def make_batches(cfg: Config, ctx: DistContext, task: BoundTask, train: Any,
                 progress: Progress) -> StreamBatches:
    """The train stream's batches, after what can be checked before training: a horizon for the schedule,
    enough shards for the lanes (and StreamBatches checks that every rank has the same shards)."""
    name, layout = f"task.name={cfg.task.name!r}", progress.layout
    if cfg.train.max_steps is None:
        raise ConfigError(f"train.max_steps is not set, and {name}'s train set is a stream, whose length is "
                          "not known before it is read: set train.max_steps (the steps the schedule plans "
                          "for; train.epochs still ends the run earlier if the stream runs out first)")
    shards = listed(cfg.task.name, "train", train)
    workers = max(1, cfg.data.num_workers)
    if len(shards) < layout.slots * workers:
        raise ConfigError(f"{name}: the train stream has {len(shards)} shard(s), and each of the global "
                          f"batch's {layout.slots} micro-batches (train.global_batch {layout.global_batch} / "
                          f"train.batch_size {layout.micro_batch}) reads shards of its own in each of "
                          f"data.num_workers={cfg.data.num_workers} loader workers, so it needs at least "
                          f"{layout.slots * workers}: split the data into more shards, or lower "
                          "data.num_workers, train.grad_accum, train.global_batch or the number of ranks")
    return StreamBatches(train, shards, progress, ctx, cfg, task)


def planned_steps(cfg: Config) -> int:
    """A stream's horizon: `train.max_steps` (make_batches checked it is set)."""
    assert cfg.train.max_steps is not None
    return cfg.train.max_steps
