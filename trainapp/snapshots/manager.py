"""Rank-0 snapshots: the cadence, the write (in the background with `snapshot.async`), the storage
failures a run survives, and the load of the newest valid snapshot on start.

With `snapshot.async`, rank 0 blocks only while it copies the state into CPU memory (the previous
snapshot's buffers, reused); a background thread writes that copy the same atomic way. One write is
in flight at most: the next snapshot (and the end of training) waits for it. A sharded snapshot (FSDP)
goes the same way on every rank: each copies its shards to CPU memory and DCP's thread writes them
(`async_save`); at each step boundary the ranks agree whether every shard is written (`poll`), and
then rank 0 publishes the snapshot as a synchronous one: nothing is published before every rank's
shard is on disk and checksummed.

A storage error (a full disk, a read-only mount, a directory rank 0 may not write, I/O errors) drops
that snapshot, leaves nothing half-written, and training goes on; `snapshot.max_failures` in a row,
or a failed final snapshot, stop every rank at once with `StorageError` (exit 3) and one line naming
the cause, the place and the fix. Where snapshots go, and their retention, is the publish step's
(trainapp/snapshots/publish.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, cast

from trainapp.errors import ConfigError, Failure
from trainapp.snapshots.files import Buffers, cpu_copy, is_storage_error, no_space_left, storage_hint
from trainapp.snapshots.lease import Fence
from trainapp.snapshots.memory import MemoryTier
from trainapp.snapshots.publish import Publish
from trainapp.snapshots.store import (
    Disk,
    check_seen,
    merged,
    newest_valid,
    own_shards,
    staging,
    start_shards,
    step_name,
    write_dir,
    write_shards,
)

if TYPE_CHECKING:
    import torch.distributed as dist

    from trainapp.config import SnapshotSection
    from trainapp.group import DistContext

log = logging.getLogger(__name__)


class StorageError(Failure):
    """Snapshots cannot be written (`snapshot.max_failures` in a row, or the final one): exit 3."""

    cause = "storage"
    exit_code = 3
    everywhere = True  # every rank raises it at the same step (the verdict is broadcast): nobody to tell


class _Watch(Protocol):
    """What the manager tells the rank's heartbeat (trainapp/faults/heartbeat.py's, a layer above)."""

    def progress(self) -> None: ...

    def wait_for(self, thread: threading.Thread) -> None: ...

    def writing(self, where: Path) -> contextlib.AbstractContextManager[None]: ...


class _Unwatched:
    """The heartbeat of a manager no watchdog watches (benchmarks, tests): progress is not noted."""

    def progress(self) -> None:
        pass

    def wait_for(self, thread: threading.Thread) -> None:
        thread.join()

    def writing(self, where: Path) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@dataclass
class _ShardsInFlight:
    """An asynchronous sharded snapshot being written: every rank's future; rank 0's copy of the rest."""

    step: int
    tmp: Path
    future: Any
    state: dict[str, Any] | None
    meta: dict[str, Any] | None


@dataclass(frozen=True)
class SnapshotRequest:
    """What a snapshot is for, beyond its step: what its failure means and how it is announced."""

    final: bool = False
    """The run's last (its end, or a stop's): a failure to write it ends the run."""
    urgent: bool = False
    """Announced at once (a drain notice's), not on the publish step's own schedule."""
    announce: bool = True
    """Announced at all; False for a Ray resize's snapshot, which the next group finds on storage, while
    Ray Train's controller, waiting for it, could not take the report."""


class SnapshotManager:
    """Owns the cadence, the writing and the loading of snapshots; `publish` is the one step that
    differs between launchers (LocalPublish, or Ray Train's). The loop calls `due`, then `save` on every
    rank; rank 0 does the file work. `heartbeat` (the rank guard's) hears of every chunk written."""

    def __init__(self, publish: Publish, every_steps: int = 50, async_write: bool = False,
                 max_failures: int = 3, disk: Disk | None = None, heartbeat: _Watch | None = None,
                 fence: Fence | None = None) -> None:
        self.publish, self.root = publish, publish.root
        self.fence = fence or Fence.none()
        """The run's lease: checked before a snapshot is published (trainapp/snapshots/lease.py)."""
        self.every_steps, self.async_write, self.max_failures = every_steps, async_write, max_failures
        self.disk = disk or Disk()
        """What every write goes through (a failure drill's slow disk: trainapp/faults/drills.py)."""
        self.heartbeat: _Watch = heartbeat or _Unwatched()
        self.last_blocking_s = 0.0
        """Seconds the last `save` held training (the copy with async writes, the whole write without)."""
        self.failures = 0
        """Rank 0: snapshots that failed in a row (a storage error: ENOSPC, EIO, EROFS, EACCES)."""
        self.failed: list[dict[str, Any]] = []
        """Rank 0: failures not yet recorded in metrics.jsonl (the loop takes them)."""
        self.last_written: Path | str | None = None
        """Rank 0: where this process's last successful snapshot went."""
        self.published_step: int | None = None
        """Rank 0: the step of that snapshot (what a restart could resume from; trackers send up to it)."""
        self._pending: threading.Thread | None = None
        self._staging: Any = None  # the CPU copy the last async snapshot was written from (see cpu_copy)
        self._error: BaseException | None = None
        self._last: tuple[int, OSError] | None = None
        self._buffers = Buffers()
        self._shards: _ShardsInFlight | None = None
        self.memory: MemoryTier | None = None
        """The memory tier (trainapp/snapshots/memory.py), when the run has one: its cadence and copies."""
        # Gloo groups of DCP's writer thread and of `poll`
        self._groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None

    @classmethod
    def from_config(cls, s: SnapshotSection, publish: Publish, *, heartbeat: _Watch | None = None,
                    fence: Fence | None = None, disk: Disk | None = None) -> SnapshotManager:
        """The one place a run's snapshot manager is made from its `snapshot` section (`publish`: the
        launcher's)."""
        return cls(publish, s.every_steps, s.async_, s.max_failures, disk, heartbeat, fence)

    def due(self, step: int, last: bool) -> bool:
        return last or (self.every_steps > 0 and step % self.every_steps == 0)

    @property
    def where(self) -> str:
        """Where the run's snapshots go (a directory, or a URI under Ray), for the run's summary."""
        return self.publish.where

    def memory_due(self, step: int, last: bool) -> bool:
        """Whether every rank copies its share of the state to memory after `step` (never the last: the
        final snapshot is on storage)."""
        return self.memory is not None and not last and self.memory.due(step)

    def save_memory(self, ctx: DistContext, step: int, state: dict[str, Any]) -> None:
        assert self.memory is not None  # memory_due said so
        self.memory.save(ctx, step, state)
        self.last_blocking_s = self.memory.last_seconds

    def memory_summary(self) -> dict[str, Any] | None:
        """The memory tier's account for the end record (None without one)."""
        return self.memory.summary() if self.memory is not None else None

    def close_memory(self) -> None:
        """At the end of a finished run: its copies in memory deleted (on this rank's node)."""
        if self.memory is not None:
            self.memory.close(finished=True)

    def path_for(self, step: int) -> Path:
        return self.root / step_name(step)

    def load(self, ctx: DistContext) -> tuple[str, dict[str, Any]] | None:
        """(where, state) of the newest valid snapshot, the same on every rank; None to start fresh."""
        return self.publish.find(ctx)

    def save(self, ctx: DistContext, step: int, state: dict[str, Any] | None, meta: dict[str, Any] | None,
             report: dict[str, Any], request: SnapshotRequest = SnapshotRequest(),
             shards: dict[str, Any] | None = None) -> None:
        """Every rank calls this; rank 0 passes the state and writes it; then the publish step announces it
        as `request` says.

        A storage error drops this snapshot and training goes on; StorageError on every rank after
        `max_failures` in a row, or when a `final` snapshot fails (the run's last, or a preemption's).
        `shards`: every rank's shard of the sharded parts (an FSDP run)."""
        final = request.final
        t0 = time.perf_counter()
        if self.async_write and shards is not None:
            self.settle(ctx)  # the previous one published first: one in flight at most
            self.agree(ctx, final=False)
            self._start_shards(ctx, step, state, meta, shards)
        elif self.async_write:
            if ctx.is_main:
                self.wait()  # the previous write's outcome is counted now
            self.agree(ctx, final=False)  # stop before starting one write too many
            if ctx.is_main:
                copy = self._staging = cpu_copy(state, into=self._staging)
                self._pending = threading.Thread(target=self._write_in_background, args=(step, copy, meta),
                                                 name=f"snapshot-{step}")
                self._pending.start()
        else:
            staged = self._stage(ctx, step, shards) if shards is not None else None
            if ctx.is_main and (shards is None or staged is not None):
                assert state is not None and meta is not None  # rank 0 passes them
                self._attempt(step, state, meta, staged)
            self.agree(ctx, final=final)
        if request.announce:
            self.publish.announce(ctx, report, final or request.urgent)
        self.last_blocking_s = time.perf_counter() - t0

    def finish(self, ctx: DistContext, announce: bool = True) -> None:
        """Every rank, at the end of a run or a stop: the write in flight is on disk, or StorageError."""
        if ctx.is_main:
            self.wait()
        self.settle(ctx)
        self.agree(ctx, final=True)
        if announce:
            self.publish.flush(ctx)

    def _staging_dir(self, ctx: DistContext, step: int) -> Path:
        """Every rank: rank 0's staging directory of `step`, made empty, which every rank sees."""
        tmp = staging(self.path_for(step))
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        # After the mkdir; rank 0's path on every rank (the others pass None).
        tmp = Path(cast(str, ctx.files.broadcast_object(str(tmp) if ctx.is_main else None)))
        if self.publish.shared_staging:  # else each rank's shards go from its own disk (`push_shards`)
            check_seen(ctx, tmp, self.publish.setting, self.publish.where)
        return tmp

    def _stage(self, ctx: DistContext, step: int, shards: dict[str, Any]) -> dict[str, Any] | None:
        """Every rank: its shards written into rank 0's staging directory of `step` (`_collect`)."""
        tmp = self._staging_dir(ctx, step)
        return self._collect(ctx, step, tmp, lambda: write_shards(tmp, shards, self.disk))

    def _collect(self, ctx: DistContext, step: int, tmp: Path,
                 written: Callable[[], Any]) -> dict[str, Any] | None:
        """Every rank: `written()` (its shards' write, or the wait for it) under the heartbeat's watch,
        then its files checksummed and pushed where the snapshot goes; rank 0 gets every rank's listing,
        or None when some rank failed: a storage error counts as a failed snapshot, nothing is left."""
        error, own = None, {}
        try:
            with self.heartbeat.writing(tmp):  # beats while the shards grow: slow is not hung
                written()
                own = own_shards(ctx, tmp)
                self.publish.push_shards(ctx, step, tmp, list(own))
        except BaseException as e:  # DCP raises every rank's errors on every rank (a CheckpointException)
            error = e
        cause = _storage_cause(error, tmp) if error is not None else None
        everyone = ctx.files.gather_objects((own, cause, error is not None))
        if error is not None and cause is None:
            raise error
        if not ctx.is_main:
            return None
        assert everyone is not None  # rank 0 gathers
        causes = [c for _, c, _ in everyone if c is not None]
        if causes or any(failed for _, _, failed in everyone):
            shutil.rmtree(tmp, ignore_errors=True)
            self.publish.discard(step)
            if causes:
                self._count_failure(step, causes[0])
            return None
        return merged([o for o, _, _ in everyone])

    def _start_shards(self, ctx: DistContext, step: int, state: dict[str, Any] | None,
                      meta: dict[str, Any] | None, shards: dict[str, Any]) -> None:
        """Every rank: its shards of `step` copied to CPU memory, their write started in DCP's thread;
        rank 0 keeps a copy of the rest of the state for `settle`."""
        # Collectives: every rank makes them at the same snapshot.
        if self._groups is None and ctx.distributed:
            self._groups = (ctx.new_side_group(), ctx.new_side_group())
        tmp = self._staging_dir(ctx, step)
        copy = self._staging = cpu_copy(state, into=self._staging) if ctx.is_main else None
        future = start_shards(tmp, shards, self._groups[0] if self._groups else None, self.disk)
        self._shards = _ShardsInFlight(step, tmp, future, copy, meta)

    @property
    def shards_in_flight(self) -> bool:
        return self._shards is not None

    def poll(self, ctx: DistContext) -> None:
        """Every rank, at every step boundary: publish the sharded snapshot in flight once every rank's
        shards are written. While one is in flight this costs one small all-reduce a step, on a Gloo
        group of its own; otherwise nothing."""
        if self._shards is None:
            return
        import torch

        busy = torch.tensor([0 if self._shards.future.done() else 1])
        if ctx.distributed:
            import torch.distributed as dist

            assert self._groups is not None  # made with the shards in flight, when distributed
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self._groups[1])
        if busy.item() == 0:
            self.settle(ctx)

    def settle(self, ctx: DistContext) -> None:
        """Every rank: the sharded snapshot in flight, if any, written (`_collect`: waiting for this rank's
        shards); rank 0 then publishes it with every rank's listing."""
        w, self._shards = self._shards, None
        if w is None:
            return
        listing = self._collect(ctx, w.step, w.tmp, w.future.result)
        if listing is not None:
            assert w.state is not None and w.meta is not None  # rank 0's, as the listing is
            self._attempt(w.step, w.state, w.meta, listing)

    def _attempt(self, step: int, state: dict[str, Any], meta: dict[str, Any],
                 shards: dict[str, Any] | None = None) -> None:
        """Rank 0: write; on ENOSPC make room once and retry (not with shards: they are written once);
        a storage error is counted, not raised."""
        try:
            try:
                where = self.write(step, state, meta, shards)
            except OSError as e:
                if shards or e.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.publish.make_room():
                    raise
                log.warning("snapshot step=%d: %s; deleted older snapshots to make room, writing it again",
                            step, e)
                where = self.write(step, state, meta)
        except OSError as e:
            if not is_storage_error(e):
                raise
            shutil.rmtree(staging(self.path_for(step)), ignore_errors=True)
            self._count_failure(step, e)
            return
        self.failures, self._last = 0, None
        self.last_written, self.published_step = where, step

    def _count_failure(self, step: int, e: OSError) -> None:
        if e.filename is None:  # os.write's errors name no file: say which snapshot it was
            e = OSError(e.errno, e.strerror, str(self.path_for(step)))
        self.failures += 1
        self._last = (step, e)
        assert e.errno is not None  # a storage error: one of STORAGE_ERRNOS
        self.failed.append({"step": step, "errno": errno.errorcode.get(e.errno, str(e.errno)),
                            "error": str(e), "path": e.filename, "in_a_row": self.failures})
        log.warning("snapshot step=%d failed: %s; nothing half-written is left; training goes on (%d of "
                    "snapshot.max_failures=%d in a row)", step, e, self.failures, self.max_failures)

    def agree(self, ctx: DistContext, final: bool) -> None:
        """Every rank: rank 0's verdict on the snapshots so far; StorageError everywhere when fatal."""
        fatal = None
        if ctx.is_main and self._last is not None and (final or self.failures >= self.max_failures):
            fatal = self._fatal_message(final)
        fatal = ctx.files.broadcast_object(fatal)  # the others wait here while rank 0 writes
        if fatal:
            raise StorageError(fatal)

    def _fatal_message(self, final: bool) -> str:
        assert self._last is not None  # `agree` asks only after a failure
        step, e = self._last
        newest: tuple[Path | str, dict[str, Any]] | None
        try:
            newest = newest_valid(self.root)
        except ConfigError:  # none is valid: nothing to name
            newest = None
        # Published elsewhere (a URI): this process wrote it.
        if newest is None and self.last_written is not None:
            newest = (self.last_written, {})
        size = newest[1].get("bytes") if newest else None
        why = (f"the final snapshot (step {step}) failed" if final and self.failures < self.max_failures
               else f"snapshot.max_failures={self.max_failures}: {self.failures} snapshots in a row failed, "
                    f"the last at step {step}")
        kept = f"the newest valid snapshot is {newest[0]}" if newest else "there is no valid snapshot yet"
        hint = storage_hint(e, self.publish.where, size, self.publish.setting)
        return f"{why}: {e}; {hint}; {kept}; rerun to resume from it"

    def _write_in_background(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        if sys.platform == "linux":
            # Linux nices threads one by one: the writer yields the cores to training and takes what
            # is left; it has a whole snapshot interval to finish.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            self._attempt(step, state, meta)  # a storage error is counted there, for the next agree()
        except BaseException as e:  # handed to the training thread at its next save or wait
            self._error = e

    def wait(self) -> None:
        """Until the write in flight (if any) is on disk; re-raises its error in the caller."""
        if self._pending is not None:
            self.heartbeat.wait_for(self._pending)
            self._pending = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def write(self, step: int, state: dict[str, Any], meta: dict[str, Any],
              shards: dict[str, Any] | None = None) -> Path | str:
        """Rank 0 only: write the snapshot of `step` under the root (its `shards` already staged), then
        commit it where it goes."""
        t0 = time.perf_counter()
        meta = {**meta, "lease_generation": self.fence.generation}
        path = write_dir(self.path_for(step), state, meta, self.disk, self.heartbeat.progress, self._buffers,
                         before_publish=lambda: self.fence.check("snapshot"), shards=shards)
        self.fence.check("snapshot")  # a URI's upload publishes: after the local write, before that
        where = self.publish.commit(step, path)
        log.info("snapshot step=%d path=%s seconds=%.2f%s", step, where, time.perf_counter() - t0,
                 " (background)" if self._pending is not None else "")
        return where


def _storage_cause(e: BaseException, where: Path | None = None) -> OSError | None:
    """The storage error (ENOSPC, EIO, ...) behind `e`, or None when it is none. A RuntimeError of
    torch's file writer while the filesystem under `where` is full is ENOSPC: that writer drops the
    errno, and DCP's wrapper carries another rank's error pickled, without the OSError it was raised in
    the handling of."""
    graph = list(_graph(e, set()))
    found = next((x for x in graph if isinstance(x, OSError) and is_storage_error(x)), None)
    runtime = [x for x in graph if isinstance(x, RuntimeError)]
    if found is None and runtime and where is not None and no_space_left(where):
        said = (str(runtime[-1]).splitlines() or ["RuntimeError"])[0][:200]
        found = OSError(errno.ENOSPC, f"No space left on device (torch's writer said: {said})", str(where))
    return found


def _graph(e: BaseException, seen: set[int]) -> Iterator[BaseException]:
    """`e` and every error behind it, depth first: torch.distributed.checkpoint's per-rank failures (a
    CheckpointException: {rank: (exception, its stack)}), the cause, and the exception being handled when
    it was raised (torch.save raises from its writer's __exit__ while handling the write's OSError)."""
    if id(e) in seen:
        return
    seen.add(id(e))
    yield e
    failures = getattr(e, "failures", None)
    ranks = [f[0] if isinstance(f, tuple) else f
             for f in (failures.values() if isinstance(failures, dict) else [])]
    for inner in (*ranks, e.__cause__, e.__context__):
        if isinstance(inner, BaseException):
            yield from _graph(inner, seen)
