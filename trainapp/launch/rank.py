"""The launcher seam: what differs between the launchers a rank can run under (`Launcher`), and
`run_rank`, the one function every launcher calls to run a rank.

A launcher says how its process is set up (the rank's guard: signal handlers, the worker registry),
how the process group comes to be (created, or adopted from Ray Train), where snapshots are
published, where notices other than signals come from (Ray's node drains), and how many times it
has restarted this rank. Everything else is the same under every launcher: `run_rank` builds the
parts, watches the rank and trains. torchrun, Slurm (through torchrun) and a plain process use
`Torchrun` (trainapp/launch/torchrun.py); Ray Train's workers use `RayWorker`
(trainapp/launch/ray/worker.py). How a rank's ending becomes its exit is trainapp.errors'.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from trainapp.config import Config
from trainapp.core.build import Parts, build
from trainapp.core.loop import Trainer
from trainapp.errors import PEER_EXIT, Failure, first_line
from trainapp.faults.boundary import DrainNotices, StepBoundary
from trainapp.faults.drills import Drills
from trainapp.faults.guard import RankGuard
from trainapp.group import DistContext
from trainapp.launch import dist, malloc, startup
from trainapp.observe import logs
from trainapp.observe.live import LiveMetrics
from trainapp.observe.records import Records
from trainapp.snapshots.lease import RunLease
from trainapp.snapshots.manager import SnapshotManager
from trainapp.snapshots.memory import MemoryTier
from trainapp.snapshots.publish import Publish

if TYPE_CHECKING:
    from torch.distributed import Store


class Launcher:
    """What differs between launchers, asked by `run_rank` in this order. A launcher implements `guard`,
    `context`, `publish`, `lease` and `close`; the other steps default to a launcher that has none of
    them (signals its only notices, no restarts of its own to count, nothing to watch, no live metrics)."""

    @property
    def name(self) -> str:
        """What started the rank, for the start record and the trackers' tags."""
        raise NotImplementedError

    def guard(self, cfg: Config) -> RankGuard:
        """The process set up for training: the rank's guard, its signal handlers installed."""
        raise NotImplementedError

    def context(self, cfg: Config, guard: RankGuard) -> DistContext:
        """The process group, created or adopted."""
        raise NotImplementedError

    def lease(self, cfg: Config, ctx: DistContext) -> RunLease:
        """The run's lease on its directory: taken (rank 0 holds it) or the driver's (under Ray)."""
        raise NotImplementedError

    def watch(self, ctx: DistContext, held: RunLease) -> None:
        """Start watching for requests that come as no signal (a stop written to the lease `held`, a
        resize the launcher's controller asks for)."""

    def publish(self, cfg: Config, ctx: DistContext) -> Publish:
        """Where snapshots go and what makes them count."""
        raise NotImplementedError

    def drains(self, cfg: Config) -> DrainNotices | None:
        """Notices of a node going away, besides signals (None: signals only)."""
        return None

    def restart(self) -> int | None:
        """How many times the launcher restarted this rank's group, for the start record; None where the
        launcher counts them elsewhere (Ray Train's attempts are the `start` records)."""
        return None

    def live(self, cfg: Config, ctx: DistContext) -> LiveMetrics | None:
        """Where this rank's live metrics go (trainapp/observe/live.py), if anywhere; every rank calls it."""
        return None

    def close(self, ctx: DistContext | None) -> None:
        """After training, whatever ended it: tear down what `guard` and `context` set up (a process that
        lives on, as a Ray worker does, also tells its guard that signals are no notices any more)."""
        raise NotImplementedError


def run_rank(launcher: Launcher, cfg: Config, task: Any = None) -> dict[str, Any]:
    """This rank's whole run of `task` (default: the one `task.name` names) under `launcher`: set up,
    build and resume, train; the summary. Whatever ends it early is recorded and raised
    (trainapp/faults/failure.py)."""
    guard, ctx, held = launcher.guard(cfg), None, RunLease.none()
    try:
        ctx = launcher.context(cfg, guard)
        guard.timeline.mark("process_group")
        logs.setup(ctx.rank, ctx.world_size)
        held = launcher.lease(cfg, ctx)  # before anything is written to the run directory
        launcher.watch(ctx, held)
        guard.failures.fence = held.fence
        with guard.watching(cfg, ctx, lambda: _side_store(ctx)):
            built = trainer(launcher, cfg, ctx, guard, task, held)
            startup.resume_gc()
            return {**built.train(), "rank": ctx.rank}
    finally:
        startup.resume_gc()
        held.release()
        launcher.close(ctx)


def _side_store(ctx: DistContext) -> Store | None:
    try:
        return dist.side_store(ctx)
    except Exception as e:  # the group formed a moment ago: its store's host died since
        raise StoreGone(f"the group's store is unreachable ({first_line(e)}): its host, rank 0 or the "
                        "launcher, is gone") from None


class StoreGone(Failure):
    """The group's store could not be reached at the start of a rank's run: whoever hosted it is gone."""

    cause = "peer"
    exit_code = PEER_EXIT
    everywhere = True  # no store to tell the peers through


def trainer(launcher: Launcher, cfg: Config, ctx: DistContext, guard: RankGuard, task: Any = None,
            held: RunLease | None = None) -> Trainer:
    """The rank's parts, built and resumed, and the Trainer over them, its start on record; `held`: the
    run's lease, whose fence every write checks."""
    malloc.keep_freed_memory()  # before the parts and the first step allocate what every step reuses
    held = held or RunLease.none()
    publish = launcher.publish(cfg, ctx)
    guard.notices.snapshots = publish.where
    drills = Drills(cfg.drill, ctx.rank, ctx.world_size, cfg.run.dir, guard.heartbeat)
    snapshots = SnapshotManager.from_config(cfg, publish, guard.heartbeat, held.fence, drills.disk)
    records = Records(cfg, ctx, held.fence.check, held.summary, launcher.live(cfg, ctx), launcher.name)
    s = cfg.snapshot
    memory = MemoryTier.from_config(s.memory_every_steps, s.memory_dir, cfg.run.dir, ctx)
    load = snapshots.load if memory is None else functools.partial(_recover, memory, snapshots)
    parts = build(cfg, ctx, load, guard.timeline.mark, task)
    snapshots.memory = _sized(memory, ctx, parts, s.memory_peer)
    if snapshots.memory is not None:
        snapshots.memory.midway = drills.in_memory_copy
    drills.attach(parts)
    boundary = StepBoundary(ctx, guard.notices, snapshots.due, launcher.drains(cfg), cfg.preempt.ray_poll_s,
                            records.drain_notice)
    records.start(parts, dist.placement(ctx), launcher.restart(), guard.timeline.marks())
    return Trainer(cfg, ctx, parts, snapshots, guard, boundary, records,
                   (drills.after_step, records.after_step))


def _recover(memory: MemoryTier, snapshots: SnapshotManager,
             ctx: DistContext) -> tuple[str, dict[str, Any]] | None:
    """Every rank: the state to resume, from the memory tier when it holds a step at least as new as the
    newest snapshot on storage, else from storage."""
    return memory.recover(ctx, snapshots.publish.newest_step(ctx), snapshots.load)


def _sized(memory: MemoryTier | None, ctx: DistContext, parts: Parts, peer: bool) -> MemoryTier | None:
    """The memory tier once the state's size is known (None: off, it does not fit)."""
    if memory is None:
        return None
    return memory.sized(ctx, parts.state.own_bytes(), peer)
