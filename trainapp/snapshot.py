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
import mmap
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import xxhash
from torch.utils.serialization import config as torch_serialization_config

from trainapp.config import ConfigError

log = logging.getLogger(__name__)

STATE, META = "state.pt", "meta.json"
FORMAT = 2
# The checksum of state.pt: xxh3-128 (xxhash), several times cheaper than sha256 (docs/benchmarks.md), and
# a snapshot's checksum guards against torn and corrupt files, not against forgery. Format-1 snapshots
# carry a sha256 and still verify.
CHECKSUMS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_NAME = re.compile(r"^step_(\d{9})$")


class SnapshotError(ConfigError):
    """A snapshot that cannot be used (missing file, bad checksum, unreadable): bad input, exit 2."""


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


def file_digest(path: Path, algo: str = "xxh3_128") -> str:
    h = CHECKSUMS[algo]()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _StateFile:
    """The file torch.save writes a snapshot's state into: checksummed in passing (one pass over the
    bytes, not a second read of the file), and with `direct`, written with O_DIRECT through an
    aligned buffer reused across snapshots. Direct writes skip the page cache: no cache pages to
    allocate and fill, no writeback later. That roughly halves the machine's CPU per snapshot
    (docs/benchmarks.md), and the writer's CPU is what a background snapshot takes from training."""

    CHUNK = 8 << 20
    _free: list[mmap.mmap] = []
    _lock = threading.Lock()

    def __init__(self, path: Path, direct: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o644)
        self.digest, self.size, self.used = xxhash.xxh3_128(), 0, 0
        self.buf = None
        if direct:
            with self._lock:
                # page-aligned, as O_DIRECT needs; one per concurrent writer, kept for the next snapshot
                self.buf = self._free.pop() if self._free else mmap.mmap(-1, self.CHUNK)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self.digest.update(view)
        self.size += n
        if self.buf is None:
            self._write_all(view)
            return n
        while view:
            k = min(len(view), self.CHUNK - self.used)
            self.buf[self.used:self.used + k] = view[:k]
            self.used, view = self.used + k, view[k:]
            if self.used == self.CHUNK:
                self._write_all(memoryview(self.buf))
                self.used = 0
        return n

    def _write_all(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self.fd, view):]

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        """The tail (padded to whole blocks, then cut back to the real size), fsync, close."""
        if self.buf is not None and self.used:
            self._write_all(memoryview(self.buf)[:-(-self.used // 4096) * 4096])
            os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.buf is not None:
            with self._lock:
                self._free.append(self.buf)
            self.buf = None


def save_state(path: Path, state: dict[str, Any]) -> tuple[str, int]:
    """torch.save `state` to `path`, on disk when this returns; (xxh3_128 checksum, size) of the file.

    O_DIRECT first; a filesystem that refuses it (tmpfs, some network and overlay filesystems; EINVAL)
    gets an ordinary buffered write."""
    for direct in ((True, False) if hasattr(os, "O_DIRECT") else (False,)):
        try:
            f = _StateFile(path, direct)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                continue
            raise
        try:
            # torch's zip writer would also CRC32 every record: redundant with our checksum of the whole
            # file (checked on every load) and a fifth of a snapshot's CPU.
            with torch_serialization_config.patch({"save.compute_crc32": False}):
                torch.save(state, f)
            f.finish()
        except OSError as e:
            f.close()
            if direct and e.errno == errno.EINVAL:  # an alignment the filesystem will not take
                continue
            raise
        except BaseException:
            f.close()
            raise
        return f.digest.hexdigest(), f.size
    raise AssertionError("unreachable")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, write: Callable[[Any], None]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def cpu_copy(obj: Any, into: Any = None) -> Any:
    """A deep copy of a state tree with every tensor copied to CPU memory (training goes on mutating
    the originals in place while a background thread writes the copy).

    `into` is the copy made at the previous snapshot: a tensor whose shape, dtype and strides match is
    reused as the destination. Fresh memory is most of what a copy costs (a page fault per page;
    reused buffers copy several times faster, docs/benchmarks.md), and on a GPU node the reused buffers
    are pinned, so the device-to-host copies run at full speed.
    """
    cuda: list[bool] = []
    out = _copy(obj, into, cuda)
    if cuda:
        torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed before anyone reads
    return out


def _copy(obj: Any, into: Any, cuda: list[bool]) -> Any:
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if src.is_cuda:
            cuda.append(True)
        if (isinstance(into, torch.Tensor) and into.shape == src.shape and into.dtype == src.dtype
                and into.stride() == src.stride()):
            return into.copy_(src, non_blocking=src.is_cuda)
        dst = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
        return dst.copy_(src, non_blocking=src.is_cuda)
    if isinstance(obj, dict):
        into = into if isinstance(into, dict) else {}
        return {k: _copy(v, into.get(k), cuda) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(_copy(v, i, cuda) for v, i in zip(obj, into))
    return obj


def write_dir(final: Path, state: dict[str, Any], meta: dict[str, Any], delay_s: float = 0.0) -> Path:
    """Write `state` and `meta` as the snapshot directory `final`, atomically (`delay_s`: a drill's
    pause between the state file and the meta file that completes it)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        digest, size = save_state(tmp / STATE, state)
        if delay_s:
            time.sleep(delay_s)
        meta = {**meta, "format": FORMAT, "xxh3_128": digest, "bytes": size}
        _write_bytes(tmp / META, lambda f: f.write(json.dumps(meta, indent=2).encode()))
        _fsync_dir(tmp)
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
    _fsync_dir(final.parent)
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


def newest_valid(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest snapshot that verifies, warning about each newer one that does not.

    Raises ConfigError when snapshots exist but none is usable: starting over silently would
    hide the problem, and the user may want to inspect them.
    """
    snaps = list_snapshots(root)
    problems = []
    for snap in reversed(snaps):
        try:
            return snap, verify(snap)
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


def find_shared(ctx, root: Path) -> tuple[str, dict[str, Any]] | None:
    """(path, state) of the newest valid snapshot under `root`, on storage every rank sees: rank 0
    chooses, every rank loads that one. None to start fresh."""
    from trainapp import dist

    found = None
    if ctx.is_main:
        hit = newest_valid(root)
        found = str(hit[0]) if hit else None
    found = dist.broadcast_object(ctx, found)
    if found is None:
        return None
    try:
        return found, load_state(Path(found))
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

    def written(self, manager: SnapshotManager) -> None:
        """After a write, on rank 0 (in the writer's thread): purge what is no longer kept."""

    def publish(self, ctx, step: int, path: Path | None, metrics: dict[str, Any]) -> None:
        """On every rank after rank 0's write (`path`: None on other ranks and for background writes)."""

    def find(self, ctx, manager: SnapshotManager) -> tuple[str, dict[str, Any]] | None: ...


class LocalPublish:
    """Snapshots on storage every rank sees (one machine, NFS, a ReadWriteMany volume): the atomic
    rename in `write_dir` publishes, the other ranks wait at a barrier, the last `snapshot.keep` stay."""

    background = True

    def root(self, run_dir: Path) -> Path:
        return run_dir / "snapshots"

    def place(self, manager: SnapshotManager, step: int) -> Path:
        return manager.path_for(step)

    def written(self, manager: SnapshotManager) -> None:
        manager.purge()

    def publish(self, ctx, step: int, path: Path | None, metrics: dict[str, Any]) -> None:
        from trainapp import dist

        dist.barrier(ctx)

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

    @classmethod
    def from_config(cls, cfg, publish: Publish | None = None) -> SnapshotManager:
        """The one place a run's snapshot manager is made from its config."""
        publish = publish or LocalPublish()
        return cls(publish.root(Path(cfg.run.dir)), cfg.snapshot.every_steps, cfg.snapshot.keep,
                   async_write=cfg.snapshot.async_, write_delay_s=cfg.fault.snapshot_write_delay_s, publish=publish)

    def due(self, step: int, last: bool) -> bool:
        return last or (self.every_steps > 0 and step % self.every_steps == 0)

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:09d}"

    def load(self, ctx) -> tuple[str, dict[str, Any]] | None:
        """(path, state) of the newest valid snapshot, the same on every rank; None to start fresh."""
        return self.publish.find(ctx, self)

    def save(self, ctx, step: int, state: dict[str, Any] | None, meta: dict[str, Any] | None,
             metrics: dict[str, Any]) -> None:
        """Every rank calls this; rank 0 passes the state and writes it, then every rank publishes."""
        t0 = time.perf_counter()
        path = None
        if ctx.is_main:
            if self.async_write and self.publish.background:
                self.wait()
                copy = self._staging = cpu_copy(state, into=self._staging)
                self._pending = threading.Thread(target=self._write_in_background, args=(step, copy, meta),
                                                 name=f"snapshot-{step}")
                self._pending.start()
            else:
                path = self.write(step, state, meta)
        self.publish.publish(ctx, step, path, metrics)
        self.last_blocking_s = time.perf_counter() - t0

    def _write_in_background(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        if sys.platform == "linux":
            # Linux nices threads one by one: the writer yields the cores to training and takes what
            # is left; it has a whole snapshot interval to finish.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            self.write(step, state, meta)
        except BaseException as e:  # handed to the training thread at its next save or wait
            self._error = e

    def wait(self) -> None:
        """Until the write in flight (if any) is on disk; re-raises its error in the caller."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def write(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Rank 0 only: write the snapshot of `step` where the publish step wants it."""
        t0 = time.perf_counter()
        path = write_dir(self.publish.place(self, step), state, meta, self.write_delay_s)
        self.publish.written(self)
        log.info("snapshot step=%d path=%s seconds=%.2f%s", step, path, time.perf_counter() - t0,
                 " (background)" if self._pending is not None else "")
        return path

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
