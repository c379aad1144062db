"""The launcher seam, split by concern, and `run_rank`, the one function every launcher calls to run a
rank.

- `Launcher`: who the rank's process is and how it restarts: how the process is set up (the rank's
  guard: signal handlers, the worker registry), how the process group comes to be (created, or adopted
  from Ray Train), how many times the launcher restarted the group, and what ends with the process.
- `Services`: the run's services around it: the lease on the run directory and what watches it, where
  snapshots are published, notices other than signals (Ray's node drains) and live metrics. The base
  class is the run that lives in a directory every rank sees (torchrun, Slurm, alone); a launcher whose
  run lives elsewhere overrides what differs (`RayServices`, trainapp/launch/ray/worker.py).

A new launcher implements `Launcher`'s four steps and inherits the services. Everything else is the
same under every launcher: `run_rank` builds the parts, watches the rank and trains. torchrun, Slurm
(through torchrun) and a plain process use `Torchrun` (trainapp/launch/torchrun.py); Ray Train's
workers use `RayWorker` (trainapp/launch/ray/worker.py). How a rank's ending becomes its exit is
trainapp.errors'.

The configuration is read whole here and in the parts' assembler (trainapp/core/build.py): every part
below is given its own section, or the few values it uses, by keyword.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainapp.config import (Config, DistSection, NetworkSection, ObserveSection, PreemptSection, RunSection,
                             SnapshotSection)
from trainapp.core.build import Parts, build
from trainapp.core.loop import LoopSettings, Trainer
from trainapp.errors import PEER_EXIT, Failure, first_line
from trainapp.faults.boundary import DrainNotices, StepBoundary
from trainapp.faults.drills import Drills
from trainapp.faults.guard import RankGuard
from trainapp.group import DistContext
from trainapp.launch import dist, malloc
from trainapp.observe import logs
from trainapp.observe.live import LiveMetrics, serve
from trainapp.observe.records import Records
from trainapp.snapshots.lease import RunLease, take_for_group
from trainapp.snapshots.manager import SnapshotManager
from trainapp.snapshots.memory import MemoryTier
from trainapp.snapshots.publish import LocalPublish, Publish

if TYPE_CHECKING:
    from torch.distributed import Store


class Services:
    """The run's services where the run lives in `run.dir`, a directory every rank sees: rank 0 takes the
    lease, snapshots are published into `run.dir/snapshots`, signals are the only notices, live metrics
    are served on `observe.prometheus_port`. Asked by `run_rank` after the process group exists."""

    def lease(self, ctx: DistContext, run: RunSection, kind: str) -> RunLease:
        """The run's lease on its directory, taken by rank 0 for the group (`kind`: the launcher's name)."""
        return take_for_group(ctx, run.dir, kind, run.lease_s, run.take_over)

    def watch(self, ctx: DistContext, held: RunLease, guard: RankGuard) -> None:
        """Start watching for requests that come as no signal (a stop written to the lease `held`, a
        resize the launcher's controller asks for), made notices of `guard`'s. Here: none."""

    def publish(self, ctx: DistContext, run_dir: str, snapshot: SnapshotSection) -> Publish:
        """Where snapshots go and what makes them count."""
        return LocalPublish(Path(run_dir) / "snapshots", snapshot.keep)

    def drains(self, preempt: PreemptSection) -> DrainNotices | None:
        """Notices of a node going away, besides signals (None: signals only)."""
        return None

    def memory_id(self, held: RunLease) -> str | None:
        """The run's id for its copies in memory when the run directory cannot keep one every node sees
        (trainapp/snapshots/memory.py's `run_id`); None: kept in `run.dir`."""
        return None

    def live(self, ctx: DistContext, observe: ObserveSection, run_dir: str) -> LiveMetrics | None:
        """Where this rank's live metrics go (trainapp/observe/live.py), if anywhere; every rank calls it."""
        return serve(observe.prometheus_port, Path(run_dir).name, ctx)


class Launcher:
    """Who a rank's process is, asked by `run_rank` in this order: `guard`, `context`, `restart`, `close`.
    `services` are the run's (default: a run directory every rank sees)."""

    services: Services = Services()

    @property
    def name(self) -> str:
        """What started the rank, for the start record, the lease and the trackers' tags."""
        raise NotImplementedError

    def guard(self, preempt: PreemptSection) -> RankGuard:
        """The process set up for training: the rank's guard, its signal handlers installed."""
        raise NotImplementedError

    def context(self, dist_cfg: DistSection, network: NetworkSection, guard: RankGuard) -> DistContext:
        """The process group, created or adopted."""
        raise NotImplementedError

    def restart(self) -> int | None:
        """How many times the launcher restarted this rank's group, for the start record; None where the
        launcher counts them elsewhere (Ray Train's attempts are the `start` records)."""
        return None

    def close(self, ctx: DistContext | None) -> None:
        """After training, whatever ended it: tear down what `guard` and `context` set up (a process that
        lives on, as a Ray worker does, also tells its guard that signals are no notices any more)."""
        raise NotImplementedError


def run_rank(launcher: Launcher, cfg: Config, task: Any = None) -> dict[str, Any]:
    """This rank's whole run of `task` (default: the one `task.name` names) under `launcher`: set up,
    build and resume, train; the summary. Whatever ends it early is recorded and raised
    (trainapp/faults/failure.py)."""
    guard, ctx, held = launcher.guard(cfg.preempt), None, RunLease.none()
    services = launcher.services
    try:
        ctx = launcher.context(cfg.dist, cfg.network, guard)
        guard.timeline.mark("process_group")
        logs.setup(ctx.rank, ctx.world_size)
        held = services.lease(ctx, cfg.run, launcher.name)  # before anything is written to the run directory
        services.watch(ctx, held, guard)
        guard.failures.fence = held.fence
        with guard.watching(Path(cfg.run.dir), cfg.fault, ctx, lambda: _side_store(ctx)):
            built = trainer(launcher, cfg, ctx, guard, task, held)
            _started(guard)
            return {**built.train(), "rank": ctx.rank}
    finally:
        _started(guard)
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
    services, run_dir, s = launcher.services, cfg.run.dir, cfg.snapshot
    publish = services.publish(ctx, run_dir, s)
    guard.notices.snapshots = publish.where
    drills = Drills(cfg.drill, ctx.rank, ctx.world_size, run_dir, guard.heartbeat)
    snapshots = SnapshotManager.from_config(s, publish, heartbeat=guard.heartbeat, fence=held.fence,
                                            disk=drills.disk)
    records = Records(ctx, cfg.observe, run_dir, cfg.to_dict(), fence=held.fence.check, lease=held.summary,
                      live=services.live(ctx, cfg.observe, run_dir), launcher=launcher.name)
    memory = MemoryTier.from_config(s.memory_every_steps, s.memory_dir, run_dir, ctx,
                                    given_id=services.memory_id(held))
    load = snapshots.load if memory is None else functools.partial(_recover, memory, snapshots)
    parts = build(cfg, ctx, load, guard.timeline.mark, task)
    snapshots.memory = _sized(memory, ctx, parts, s.memory_peer)
    if snapshots.memory is not None:
        snapshots.memory.midway = drills.in_memory_copy
    drills.attach(parts)
    poll_s = cfg.preempt.ray_poll_s
    boundary = StepBoundary(ctx, guard.notices, snapshots.due, drains=services.drains(cfg.preempt),
                            poll_s=poll_s, on_drain=functools.partial(records.drain_notice, every_s=poll_s))
    records.start(parts.start_facts(ctx.world_size), dist.placement(ctx), launcher.restart(),
                  guard.timeline.marks())
    settings = LoopSettings(train=cfg.train, seed=cfg.seed, run_dir=run_dir, time_ranks=cfg.observe.ranks,
                            export=cfg.run.export)
    return Trainer(ctx, parts, snapshots, guard, boundary, records, settings,
                   (drills.after_step, records.after_step))


def _started(guard: RankGuard) -> None:
    """The start-up is over (the parts built, or the start failed): the collector back on."""
    if guard.gc_pause is not None:
        guard.gc_pause.end()


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
