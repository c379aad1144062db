"""A stream's batches (trainapp/streams/): the lanes of trainapp/core/lanes.py read by this rank's
loader, the position the steps consumed, and the epoch's end agreed by every rank.

Rank r runs slots r, r + W, ... of each step (trainapp/core/layout.py), so it reads those lanes. A
loader worker serves every n-th of the rank's lanes (n divides the rank's micro-batches per step, so
DataLoader's round-robin over workers gives the micro-batches in slot order) and yields each
micro-batch with the lane's position after it; the position becomes the run's only when a step
consumes the micro-batch. Before each step every rank reads its micro-batches ahead, and one
all-reduce says whether all ranks have theirs: when a lane runs dry the epoch ends on every rank at
the same step, and what the other lanes had not read is dealt first in the next epoch.

How a loader worker reads the lanes (seeded, checked at a resume, retried): trainapp/core/lane_reader.py.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import pickle
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader

from trainapp.config import ConfigError
from trainapp.core.items import DefaultCollate
from trainapp.core.lane_reader import DOCS, LaneReader, ShardError, Source, ValReader, keep
from trainapp.core.lanes import Deal
from trainapp.core.loader_start import StartCheckedLoader
from trainapp.errors import first_line

if TYPE_CHECKING:
    from trainapp.config import DataSection, TrainSection
    from trainapp.core.data import Progress
    from trainapp.core.task import BoundTask
    from trainapp.group import DistContext

log = logging.getLogger(__name__)


def shards_digest(shards: list[Any]) -> str:
    return hashlib.blake2b(repr(shards).encode(), digest_size=8).hexdigest()


def val_loader(stream: Any, shards: list[Any], ctx: DistContext, batch_size: int, num_workers: int,
               pin_memory: bool, collate: Callable[[list[Any]], Any], *, start_s: float) -> DataLoader:
    reader = ValReader(stream, shards, ctx.rank, ctx.world_size, batch_size, collate)
    workers = min(num_workers, len(reader.mine))
    return StartCheckedLoader(reader, batch_size=None, num_workers=workers, pin_memory=pin_memory,
                              start_s=start_s)


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

    def __init__(self, stream: Any, shards: list[Any], progress: Progress, ctx: DistContext,
                 task: BoundTask, *, seed: int, data_cfg: DataSection, epochs: int):
        self.stream, self.shards, self.seed = stream, shards, seed
        self.digest = shards_digest(shards)
        # Its collectives (a flag per step, positions at a snapshot or an epoch's end) on the Gloo side group,
        # in CPU tensors: no device sync in the step, and a wait past dist.timeout_s is said by name.
        self.ctx = ctx.on_side("the other ranks' next micro-batches of the train stream")
        if len(set(self.ctx.all_gather_objects(self.digest))) > 1:
            raise ConfigError(f"task.name={task.name!r}: the train stream's shards() differ between ranks; "
                              "list the same shards in the same order on every rank (sort them)")
        self.progress, self.layout = progress, progress.layout  # the step a reader starts at picks each lane
        self.collate, self.num_workers, self.epochs = task.collate, data_cfg.num_workers, epochs
        self.start_s = data_cfg.worker_start_s
        self.pin_memory = ctx.device.type == "cuda"
        self.source = Source(stream, shards, seed, task.random_items, data_cfg.shard_retries,
                              data_cfg.skip_bad_shards, batches=isinstance(task.collate, DefaultCollate))
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
        loader = StartCheckedLoader(reader, batch_size=None, num_workers=self.num_workers,
                                    pin_memory=self.pin_memory, collate_fn=keep, start_s=self.start_s,
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
        return None if gathered is None else self._merged(self.deal.state_dict(), gathered, self.account)

    def _merged(self, deal: dict[str, Any], lanes: list[dict[int, list[Any]]],
                account: dict[str, Any]) -> dict[str, Any]:
        """The state of `deal` (a copy: the lanes read on by their ranks after this) with every rank's own
        lanes' positions in it."""
        for mine in lanes:
            for lane, pos in mine.items():
                deal["pos"][lane] = list(pos)
        return {**deal, "shards": len(self.shards), "shards_digest": self.digest, "account": dict(account)}

    def own_state_dict(self) -> dict[str, Any]:
        """This rank's share of the state, without a collective (the memory tier's copy): the deal, the
        positions of its own lanes, its account."""
        assert self.deal is not None
        return {"deal": self.deal.state_dict(), "mine": {k: list(self.deal.pos[k]) for k in self._mine()},
                "account": dict(self.account)}

    def load_own(self, own: dict[str, Any]) -> None:
        """Every rank, from its share (`own_state_dict`): every rank's lanes merged, then loaded."""
        everyone = self.ctx.all_gather_objects(own)
        self.load_state_dict(self._merged(everyone[0]["deal"], [o["mine"] for o in everyone],
                                          everyone[0]["account"]))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["shards"] != len(self.shards) or state["shards_digest"] != self.digest:
            raise ValueError(f"the train stream's shards() differ from the snapshot's ({state['shards']} "
                             f"then, {len(self.shards)} now, or another order)")
        self.deal = Deal.from_state(state)
        self.account.update(state.get("account", {}))


def make_batches(ctx: DistContext, task: BoundTask, train: Any, progress: Progress, *, seed: int,
                 data_cfg: DataSection, train_cfg: TrainSection) -> StreamBatches:
    """The train stream's batches, after what can be checked before training: a horizon for the schedule,
    enough shards for the lanes (and StreamBatches checks that every rank has the same shards)."""
    name, layout = f"task.name={task.name!r}", progress.layout
    if train_cfg.max_steps is None:
        raise ConfigError(f"train.max_steps is not set, and {name}'s train set is a stream, whose length is "
                          "not known before it is read: set train.max_steps (the steps the schedule plans "
                          "for; train.epochs still ends the run earlier if the stream runs out first)")
    shards = listed(task.name, "train", train)
    workers = max(1, data_cfg.num_workers)
    if len(shards) < layout.slots * workers:
        raise ConfigError(f"{name}: the train stream has {len(shards)} shard(s), and each of the global "
                          f"batch's {layout.slots} micro-batches (train.global_batch {layout.global_batch} / "
                          f"train.batch_size {layout.micro_batch}) reads shards of its own in each of "
                          f"data.num_workers={data_cfg.num_workers} loader workers, so it needs at least "
                          f"{layout.slots * workers}: split the data into more shards, or lower "
                          "data.num_workers, train.grad_accum, train.global_batch or the number of ranks")
    return StreamBatches(train, shards, progress, ctx, task, seed=seed, data_cfg=data_cfg,
                         epochs=train_cfg.epochs)


def planned_steps(max_steps: int | None) -> int:
    """A stream's horizon: `train.max_steps` (make_batches checked it is set)."""
    assert max_steps is not None
    return max_steps
