"""The bytes of a snapshot: `state.pt` written once, checksummed in passing, with O_DIRECT where the
filesystem takes it, fsynced; and the CPU staging copy an async snapshot is written from.

trainapp/snapshots/store.py builds the snapshot directory and its atomic publication on these; the
storage errors a run survives (a full disk, a read-only mount, a directory it may not write) are
named here.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import shutil
import threading
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
import xxhash
from torch.utils.serialization import config as torch_serialization_config

from trainapp.snapshots.loadable import same_kind

if TYPE_CHECKING:
    from typing_extensions import Buffer


class _Hash(Protocol):
    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


# The checksum of state.pt: xxh3-128 (xxhash), several times cheaper than sha256 (docs/benchmarks.md), and
# a snapshot's checksum guards against torn and corrupt files, not against forgery. Format-1 snapshots
# carry a sha256 and still verify.
CHECKSUMS: MappingProxyType[str, Callable[[], _Hash]] = MappingProxyType(
    {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256})


# Failures of the storage, not of trainapp: a snapshot that hits one is dropped (nothing half-written
# stays) and training goes on; other errors are bugs and end the run.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM})


def is_storage_error(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in STORAGE_ERRNOS


def no_space_left(path: Path) -> bool:
    """Whether the filesystem holding `path` (or its nearest existing parent) has no block or no inode
    left for this process (root may use the blocks ext4 reserves). torch's own file writer (the one
    torch.distributed.checkpoint's shards go through) reports a full disk as a RuntimeError about its zip
    position, its errno lost; this is how such an error is known for what it is."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    # A few blocks may stay free: a write of a block or more failed, the ones below it fit.
    return blocks * st.f_frsize < 64 * 1024 or (st.f_files > 0 and st.f_favail == 0)


def storage_hint(e: OSError, root: Path | str, size: int | None, setting: str = "run.dir") -> str:
    """What would fix a storage error, for its one-line message (`setting`: the key that names the
    storage)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        need = f" (a snapshot takes about {size / 1e6:.1f} MB)" if size else ""
        return f"free space under {root}{need} or point {setting} at a larger volume"
    if e.errno == errno.EROFS:
        return f"{root} is on a read-only filesystem: remount it read-write or point {setting} elsewhere"
    if e.errno in (errno.EACCES, errno.EPERM):
        return (f"{_writer()} may not write there: fix the directory's owner or mode, or point {setting} "
                "elsewhere")
    return (f"the storage under {root} reports I/O errors: check the disk, the network filesystem or the "
            "object store")


def _writer() -> str:
    """Who was refused: `uid N`, and for root the capability it lacks (a container with its capabilities
    dropped), since root without CAP_DAC_OVERRIDE (bit 1 of CapEff) is refused like any other uid."""
    uid = os.getuid()
    if uid != 0:
        return f"uid {uid}"
    with open("/proc/self/status") as f:
        eff = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), ~0)
    return "uid 0" if eff & (1 << 1) else "uid 0 without CAP_DAC_OVERRIDE"


def file_digest(path: Path, algo: str = "xxh3_128") -> str:
    h = CHECKSUMS[algo]()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Buffers:
    """Page-aligned buffers for O_DIRECT writes (one per concurrent writer), kept for the next snapshot."""

    CHUNK = 8 << 20

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            return self._free.pop() if self._free else mmap.mmap(-1, self.CHUNK)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)


class _StateFile:
    """The file torch.save writes a snapshot's state into: checksummed in passing (one pass over the
    bytes, not a second read of the file), and with `direct`, written with O_DIRECT through an
    aligned buffer from `buffers`. Direct writes skip the page cache: no cache pages to allocate and
    fill, no writeback later. That roughly halves the machine's CPU per snapshot (docs/benchmarks.md),
    and the writer's CPU is what a background snapshot takes from training. Every chunk calls
    `progress` (the heartbeat's: a long write is progress, for the hang watchdog)."""

    def __init__(self, path: Path, direct: bool, progress: Callable[[], None], buffers: Buffers) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o644)
        self.digest, self.size, self.used = xxhash.xxh3_128(), 0, 0
        self.progress, self.buffers = progress, buffers
        self.buf = buffers.take() if direct else None
        self.chunk = Buffers.CHUNK

    def write(self, data: Buffer) -> int:
        self.progress()
        view = memoryview(data).cast("B")
        n = len(view)
        self.digest.update(view)
        self.size += n
        if self.buf is None:
            self._write_all(view)
            return n
        while view:
            k = min(len(view), self.chunk - self.used)
            self.buf[self.used:self.used + k] = view[:k]
            self.used, view = self.used + k, view[k:]
            if self.used == self.chunk:
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
            self.buffers.give(self.buf)
            self.buf = None


def save_state(path: Path, state: dict[str, Any], progress: Callable[[], None] = lambda: None,
               buffers: Buffers | None = None) -> tuple[str, int]:
    """torch.save `state` to `path`, on disk when this returns; (xxh3_128 checksum, size) of the file.

    O_DIRECT first; a filesystem that refuses it (tmpfs, some network and overlay filesystems; EINVAL)
    gets an ordinary buffered write."""
    buffers = buffers or Buffers()
    for direct in ((True, False) if hasattr(os, "O_DIRECT") else (False,)):
        try:
            f = _StateFile(path, direct, progress, buffers)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                continue
            raise
        try:
            # torch's zip writer would also CRC32 every record: redundant with our checksum of the whole
            # file (checked on every load) and a fifth of a snapshot's CPU.
            # torch installs `patch` on its config modules at import (install_config_module): not in its
            # annotations.
            with torch_serialization_config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
                # torch.save only writes and flushes the file it is given, but annotates IO[bytes].
                torch.save(state, f)  # type: ignore[arg-type]
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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(stage: Path, final: Path) -> Path:
    """The complete directory `stage` renamed to `final`. One that is there already (the same step written
    again, an export replaced) is moved aside first, so the name never points at a half-written
    directory, and deleted after; the parent fsynced."""
    old = None
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
    os.rename(stage, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_bytes(path: Path, write: Callable[[Any], None]) -> None:
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
        dst = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="cpu",
                                  pin_memory=src.is_cuda)
        return dst.copy_(src, non_blocking=src.is_cuda)
    if isinstance(obj, dict):
        into = into if isinstance(into, dict) else {}
        return same_kind(obj, {k: _copy(v, into.get(k), cuda) for k, v in obj.items()})  # as torch.save
    if isinstance(obj, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(_copy(v, i, cuda) for v, i in zip(obj, into))
    return obj


def local_bytes(obj: Any) -> int:
    """Bytes of the tensors in `obj` (nested dicts and lists) this rank holds (a DTensor's local shard)."""
    if isinstance(obj, dict):
        return sum(local_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(local_bytes(v) for v in obj)
    if torch.is_tensor(obj):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    return 0
