"""Rank-0 snapshots: cadence, atomic writes, checksums, keep-last-k, newest-valid on load.

A snapshot is a directory `step_000000123/` holding `state.pt` (everything needed to continue exactly)
and `meta.json` (step, epoch, world size, the checksum and size of state.pt). It is written under a
temporary name, every file fsynced, `meta.json` last, then renamed into place: a directory with that
name is complete by construction. On load the checksum is verified, and a corrupt or truncated
snapshot is reported and skipped in favour of the previous one.

The same directory is what Ray Train stores as a checkpoint, so one format serves every launcher.

With `snapshot.async`, rank 0 blocks only while it copies the state into CPU memory (the previous
snapshot's buffers, reused); a background thread writes that copy the same atomic way. One write is
in flight at most: the next snapshot (and the end of training) waits for it. A process killed
mid-write leaves a `.tmp-*` directory, never a `step_*` one, so the previous snapshot stays the
newest valid.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from trainapp.faults import heartbeat
from trainapp.config import ConfigError
from trainapp.snapshots.files import (CHECKSUMS, cpu_copy, file_digest, fsync_dir, is_storage_error, save_state, storage_hint,
                               write_bytes)

log = logging.getLogger(__name__)

STATE, META = "state.pt", "meta.json"
FORMAT = 2
_NAME = re.compile(r"^step_(\d{9})$")


class SnapshotError(ConfigError):
    """A snapshot that cannot be used (missing file, bad checksum, unreadable): bad input, exit 2."""


class StorageError(Exception):
    """Snapshots cannot be written (`snapshot.max_failures` in a row, or the final one): exit 3."""

    exit_code = 3
    failure_cause = "storage"
    everywhere = True  # every rank raises it at the same step (the verdict is broadcast): nobody to tell


def step_name(step: int) -> str:
    """The directory name of the snapshot of `step` (`step_000000123`), on every kind of storage."""
    return f"step_{step:09d}"


def step_of(name: str) -> int | None:
    """The step a snapshot directory's name stands for (`step_000000123`: 123); None for other names."""
    return int(m.group(1)) if (m := _NAME.match(name)) else None


def tensors_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the raw bytes of every tensor, in sorted key order."""
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().to("cpu").contiguous().reshape(-1)
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def params_sha256(module: torch.nn.Module) -> str:
    """sha256 over a model's parameters and buffers (its state_dict), in sorted name order."""
    return tensors_sha256(module.state_dict())


def write_dir(final: Path, state: dict[str, Any], meta: dict[str, Any], delay_s: float = 0.0) -> Path:
    """Write `state` and `meta` as the snapshot directory `final`, atomically (`delay_s`: a drill's
    pause between the state file and the meta file that completes it)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        digest, size = save_state(tmp / STATE, state)
        end = time.monotonic() + delay_s
        while time.monotonic() < end:  # a slow write, not a hung one: it beats as a real one does
            time.sleep(max(0.0, min(0.5, end - time.monotonic())))
            heartbeat.progress()
        meta = {**meta, "format": FORMAT, "xxh3_128": digest, "bytes": size}
        write_bytes(tmp / META, lambda f: f.write(json.dumps(meta, indent=2).encode()))
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        # Same step written again (e.g. a run resumed from its final snapshot): move the old one aside
        # first so the name never points at a half-state.
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)
    return final


def read_meta(snap: Path) -> dict[str, Any]:
    try:
        meta = json.loads((snap / META).read_text())
    except FileNotFoundError:
        raise SnapshotError(f"{snap}: no {META} (incomplete snapshot)") from None
    except (OSError, ValueError) as e:
        raise SnapshotError(f"{snap}/{META}: unreadable ({e})") from None
    if not isinstance(meta, dict) or not any(k in meta for k in CHECKSUMS):
        raise SnapshotError(f"{snap}/{META}: not a trainapp snapshot record")
    return meta


def verify(snap: Path) -> dict[str, Any]:
    """Meta of a complete, intact snapshot; SnapshotError saying what is wrong otherwise."""
    meta = read_meta(snap)
    state = snap / STATE
    if not state.is_file():
        raise SnapshotError(f"{state}: missing")
    size = state.stat().st_size
    if size != meta.get("bytes"):
        raise SnapshotError(f"{state}: {size} bytes, expected {meta.get('bytes')} (truncated?)")
    algo = next(k for k in CHECKSUMS if k in meta)
    if file_digest(state, algo) != meta[algo]:
        raise SnapshotError(f"{state}: checksum mismatch ({algo}; corrupt)")
    return meta


def load_state(snap: Path, name: str = STATE) -> dict[str, Any]:
    """Every rank loads to CPU first, then moves what it needs to its own device."""
    try:
        state = torch.load(snap / name, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise SnapshotError(f"{snap / name}: cannot be loaded as a snapshot ({e.__class__.__name__}: {first})") from None
    if not isinstance(state, dict) or "model" not in state:
        raise SnapshotError(f"{snap / name}: not a trainapp snapshot (no model state)")
    return state


def list_snapshots(root: Path) -> list[Path]:
    """Snapshot directories under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))


def newest_valid(root: Path | str, snaps: list | None = None, local=contextlib.nullcontext):
    """(snapshot, meta) of the newest of `snaps` (oldest first; default: those under `root`) that
    verifies, warning about each newer one that does not; `local(snap)`: a context that gives it as a
    local directory (a download, for a URI). Raises ConfigError when snapshots exist but none is
    usable: starting over silently would hide the problem, and the user may want to inspect them."""
    snaps = list_snapshots(Path(root)) if snaps is None else snaps
    problems = []
    for snap in reversed(snaps):
        try:
            with local(snap) as d:
                return snap, verify(Path(d))
        except SnapshotError as e:
            problems.append(str(e))
            log.warning("skipping snapshot: %s; falling back to the previous one", e)
    if snaps:
        raise ConfigError(f"{root}: {len(snaps)} snapshot(s) but none is valid ({problems[0]}); "
                          "move them away to start over")
    return None


def resolve(path: str | Path) -> Path:
    """A snapshot directory from a snapshot file, a snapshot dir, a snapshots dir or a run dir."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: no such file or directory; pass a snapshot, a snapshots/ dir or a run dir")
    if p.is_file():
        p = p.parent
    if (p / META).exists() or (p / STATE).exists():
        return p
    for candidate in (p / "snapshots", p):
        if list_snapshots(candidate):
            found = newest_valid(candidate)
            if found:
                return found[0]
    raise ConfigError(f"{p}: holds no snapshot (expected {STATE} + {META}, a snapshots/ dir or step_* dirs)")


def find_shared(ctx, root: Path | str, snaps: list | None = None,
                local=contextlib.nullcontext) -> tuple[str, dict[str, Any]] | None:
    """(path, state) of the newest valid snapshot under `root` (`snaps`, `local`: as `newest_valid`; on
    rank 0), on storage every rank sees: rank 0 chooses, every rank loads that one. None to start fresh."""
    from trainapp.launch import dist

    hit = newest_valid(root, snaps, local) if ctx.is_main else None
    found = dist.broadcast_object(ctx, str(hit[0]) if hit else None)
    if found is None:
        return None
    try:
        with local(found) as d:
            return found, load_state(Path(d))
    except FileNotFoundError:
        raise ConfigError(
            f"{root}: rank {ctx.rank} on {os.uname().nodename} cannot see snapshot {found} that rank 0 "
            "chose; the run directory must be storage every node sees") from None


class Publish(Protocol):
    """The step that makes a written snapshot count, and finds the newest one again on start."""

    background: bool
    """Whether the write may run in a background thread (`snapshot.async`)."""

    def root(self, run_dir: Path) -> Path: ...

    def place(self, manager: SnapshotManager, step: int) -> Path:
        """Where rank 0 writes the snapshot of `step`."""

    def written(self, manager: SnapshotManager, step: int, path: Path) -> Path | str:
        """After a write, on rank 0 (in the writer's thread): take it where it goes (an upload; an
        OSError here counts as a failed snapshot), purge what is no longer kept; where it is now."""

    def make_room(self, manager: SnapshotManager) -> int:
        """After ENOSPC, on rank 0: delete older snapshots (never the newest valid one); how many."""

    def destination(self, manager: SnapshotManager) -> tuple[str, str]:
        """(where snapshots go, the setting that names it), for the one line of a storage error."""

    def due(self) -> bool:
        """Rank 0, at a snapshot: whether to publish it now (broadcast: every rank publishes at the same ones)."""

    def publish(self, ctx, metrics: dict[str, Any], now: bool) -> None:
        """On every rank after rank 0's write (or its start, for background writes); `now`: the agreed
        answer of `due`."""

    def flush(self, ctx) -> None:
        """Every rank, once the last write is on storage (the end of a run, a stop): make it count too."""

    def find(self, ctx, manager: SnapshotManager) -> tuple[str, dict[str, Any]] | None: ...


class LocalPublish:
    """Snapshots on storage every rank sees (one machine, NFS, a ReadWriteMany volume): the atomic
    rename in `write_dir` publishes, the last `snapshot.keep` stay."""

    background = True

    def root(self, run_dir: Path) -> Path:
        return run_dir / "snapshots"

    def place(self, manager: SnapshotManager, step: int) -> Path:
        return manager.path_for(step)

    def written(self, manager: SnapshotManager, step: int, path: Path) -> Path:
        manager.purge()
        return path

    def make_room(self, manager: SnapshotManager) -> int:
        return manager.keep_newest_valid()

    def destination(self, manager: SnapshotManager) -> tuple[str, str]:
        return str(manager.root), "run.dir"

    def flush(self, ctx) -> None:
        pass  # the rename published it

    def due(self) -> bool:
        return True

    def publish(self, ctx, metrics: dict[str, Any], now: bool) -> None:
        pass  # the rename published it; the other ranks waited for rank 0 in the manager's `agree`

    def find(self, ctx, manager: SnapshotManager) -> tuple[str, dict[str, Any]] | None:
        return find_shared(ctx, manager.root)


@dataclass
class SnapshotManager:
    """Owns the cadence, writing, purging and loading of snapshots; `publish` is the one step that
    differs between launchers (LocalPublish, or the Ray launcher's ray.train.report).

    The loop calls `due`, then `save` and `load` on every rank; rank 0 does the file work, in the
    background with `async_write` where the publish step allows it.
    """

    root: Path
    every_steps: int
    keep: int
    async_write: bool = False
    write_delay_s: float = 0.0
    """Failure drill (`fault.snapshot_write_delay_s`): a pause inside every write, before the meta
    file that completes the snapshot."""
    publish: Publish = field(default_factory=LocalPublish)
    last_blocking_s: float = 0.0
    """Seconds the last `save` held training (the copy with async writes, the whole write without)."""
    _pending: threading.Thread | None = field(default=None, repr=False)
    _staging: Any = field(default=None, repr=False)
    """The CPU copy the last async snapshot was written from, reused by the next one (see cpu_copy)."""
    _error: BaseException | None = field(default=None, repr=False)
    max_failures: int = 3
    """`snapshot.max_failures`: failed snapshots in a row that stop the run (StorageError)."""
    failures: int = 0
    """Rank 0: snapshots that failed in a row (a storage error: ENOSPC, EIO, EROFS, EACCES)."""
    failed: list[dict[str, Any]] = field(default_factory=list)
    """Rank 0: failures not yet recorded in metrics.jsonl (the loop takes them)."""
    _last: tuple[int, OSError] | None = field(default=None, repr=False)
    last_written: Path | str | None = None
    """Rank 0: where this process's last successful snapshot went."""

    @classmethod
    def from_config(cls, cfg, publish: Publish | None = None) -> SnapshotManager:
        """The one place a run's snapshot manager is made from its config."""
        publish = publish or LocalPublish()
        return cls(publish.root(Path(cfg.run.dir)), cfg.snapshot.every_steps, cfg.snapshot.keep,
                   async_write=cfg.snapshot.async_, write_delay_s=cfg.fault.snapshot_write_delay_s, publish=publish,
                   max_failures=cfg.snapshot.max_failures)

    def due(self, step: int, last: bool) -> bool:
        return last or (self.every_steps > 0 and step % self.every_steps == 0)

    def path_for(self, step: int) -> Path:
        return self.root / step_name(step)

    def load(self, ctx) -> tuple[str, dict[str, Any]] | None:
        """(path, state) of the newest valid snapshot, the same on every rank; None to start fresh."""
        return self.publish.find(ctx, self)

    def save(self, ctx, step: int, state: dict[str, Any] | None, meta: dict[str, Any] | None,
             metrics: dict[str, Any], final: bool = False, urgent: bool = False) -> None:
        """Every rank calls this; rank 0 passes the state and writes it; every rank publishes it if `final`,
        `urgent` (a drain notice's) or `publish.due()`.

        A storage error drops this snapshot and training goes on; StorageError on every rank after
        `max_failures` in a row, or when the `final` snapshot fails (the run's last, or a preemption's)."""
        t0 = time.perf_counter()
        now = final or urgent or (ctx.is_main and self.publish.due())
        if self.async_write and self.publish.background:
            if ctx.is_main:
                self.wait()  # the previous write's outcome is counted now
            now = self.agree(ctx, final=False, now=now)  # stop before starting one write too many
            if ctx.is_main:
                copy = self._staging = cpu_copy(state, into=self._staging)
                self._pending = threading.Thread(target=self._write_in_background, args=(step, copy, meta),
                                                 name=f"snapshot-{step}")
                self._pending.start()
        else:
            if ctx.is_main:
                self._attempt(step, state, meta)
            now = self.agree(ctx, final=final, now=now)
        self.publish.publish(ctx, metrics, now)
        self.last_blocking_s = time.perf_counter() - t0

    def finish(self, ctx) -> None:
        """Every rank, at the end of a run or a stop: the write in flight is on disk, or StorageError."""
        if ctx.is_main:
            self.wait()
        self.agree(ctx, final=True)
        self.publish.flush(ctx)

    def _attempt(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Rank 0: write; on ENOSPC make room once and retry; a storage error is counted, not raised."""
        try:
            try:
                path = self.write(step, state, meta)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.publish.make_room(self):
                    raise
                log.warning("snapshot step=%d: %s; deleted older snapshots to make room, writing it again", step, e)
                path = self.write(step, state, meta)
        except OSError as e:
            if not is_storage_error(e):
                raise
            if e.filename is None:  # os.write's errors name no file: say which snapshot it was
                e = OSError(e.errno, e.strerror, str(self.path_for(step)))
            self.failures += 1
            self._last = (step, e)
            self.failed.append({"step": step, "errno": errno.errorcode.get(e.errno, str(e.errno)), "error": str(e),
                                "path": e.filename, "in_a_row": self.failures})
            log.warning("snapshot step=%d failed: %s; nothing half-written is left; training goes on (%d of "
                        "snapshot.max_failures=%d in a row)", step, e, self.failures, self.max_failures)
            return
        self.failures, self._last = 0, None
        self.last_written = path

    def agree(self, ctx, final: bool, now: bool = True) -> bool:
        """Every rank: rank 0's verdict on the snapshots so far (StorageError everywhere when fatal) and its `now`."""
        from trainapp.launch import dist

        fatal = None
        if ctx.is_main and self._last is not None and (final or self.failures >= self.max_failures):
            fatal = self._fatal_message(final)
        fatal, now = dist.broadcast_object(ctx, (fatal, now))
        if fatal:
            raise StorageError(fatal)
        return now

    def _fatal_message(self, final: bool) -> str:
        step, e = self._last
        newest = self._newest()
        if newest is None and self.last_written is not None:  # published elsewhere (a URI): this process wrote it
            newest = (self.last_written, {})
        size = newest[1].get("bytes") if newest else None
        why = (f"the final snapshot (step {step}) failed" if final and self.failures < self.max_failures
               else f"snapshot.max_failures={self.max_failures}: {self.failures} snapshots in a row failed, the last "
                    f"at step {step}")
        kept = f"the newest valid snapshot is {newest[0]}" if newest else "there is no valid snapshot yet"
        where, setting = self.publish.destination(self)
        return f"{why}: {e}; {storage_hint(e, where, size, setting)}; {kept}; rerun to resume from it"

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
            heartbeat.wait_for(self._pending)
            self._pending = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def write(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> Path | str:
        """Rank 0 only: write the snapshot of `step` where the publish step wants it."""
        t0 = time.perf_counter()
        path = write_dir(self.publish.place(self, step), state, meta, self.write_delay_s)
        path = self.publish.written(self, step, path)
        log.info("snapshot step=%d path=%s seconds=%.2f%s", step, path, time.perf_counter() - t0,
                 " (background)" if self._pending is not None else "")
        return path

    def _newest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest valid snapshot, None when there is none (not an error here: nothing to keep)."""
        try:
            return newest_valid(self.root)
        except ConfigError:
            return None

    def keep_newest_valid(self) -> int:
        """Delete every snapshot but the newest valid one (room after ENOSPC); how many went."""
        newest = self._newest()  # None when no snapshot is valid: none worth keeping
        older = [p for p in list_snapshots(self.root) if newest is None or p != newest[0]]
        for old in older:
            shutil.rmtree(old, ignore_errors=True)
        self.sweep_leftovers()
        return len(older)

    def purge(self) -> None:
        """Keep the newest `keep` snapshots; sweep what killed writers left behind."""
        snaps = list_snapshots(self.root)
        for old in snaps[: max(0, len(snaps) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        self.sweep_leftovers()

    def sweep_leftovers(self) -> None:
        # Leftovers of writes that died (a killed process): one write at a time, and it just ended.
        for leftover in self.root.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
