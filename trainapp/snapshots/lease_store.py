"""Where a run's lease lives (trainapp/snapshots/lease.py): a folder of small files on a filesystem
(local, NFS, a ReadWriteMany volume) or at a URI through pyarrow, with the one operation a lease
needs beyond reading and writing, a create that only one contender can win.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyarrow.fs import FileSystem

FOLDER = "lease"
"""The lease's folder under the run directory."""




class DirStore:
    """The lease folder on a filesystem (local, NFS, a ReadWriteMany volume)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.where = str(self.path)

    def names(self) -> list[str]:
        try:
            return os.listdir(self.path)
        except FileNotFoundError:
            return []

    def read(self, name: str) -> bytes | None:
        try:
            return (self.path / name).read_bytes()
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return os.path.exists(self.path / name)

    def create(self, name: str, data: bytes) -> bool:
        """Write `name` whole if nobody has; False when it exists (another contender won)."""
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".{name}.{socket.gethostname()}.{os.getpid()}.tmp"
        self._write(tmp, data, sync=True)
        try:
            os.link(tmp, self.path / name)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            return self._create_exclusive(name, data)  # a filesystem without hard links
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        with contextlib.suppress(OSError):
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return True

    def _create_exclusive(self, name: str, data: bytes) -> bool:
        try:
            fd = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return True

    def replace(self, name: str, data: bytes) -> None:
        tmp = self.path / f".{name}.{os.getpid()}.renew"
        self._write(tmp, data, sync=False)  # a heartbeat: one lost to a crash is as good as a late one
        os.replace(tmp, self.path / name)

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / name).unlink()

    @staticmethod
    def _write(path: Path, data: bytes, sync: bool) -> None:
        with open(path, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())


class ArrowStore:
    """The lease folder at a URI (`ray.storage_path=s3://...`), through a pyarrow filesystem. An object
    store has no create-if-absent through pyarrow: `create` looks, writes, waits `settle_s` and reads
    back, and the contender whose record it finds there won (a later writer overwrote the others):
    two contenders lose this race together only if a write takes longer than `settle_s`."""

    def __init__(self, fs: FileSystem, path: str, where: str, settle_s: float = 1.0) -> None:
        self.fs, self.path, self.where, self.settle_s = fs, path.rstrip("/"), where, settle_s

    def names(self) -> list[str]:
        from pyarrow.fs import FileSelector

        return [i.base_name for i in self.fs.get_file_info(FileSelector(self.path, allow_not_found=True))]

    def read(self, name: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(f"{self.path}/{name}") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        from pyarrow.fs import FileType

        return self.fs.get_file_info(f"{self.path}/{name}").type != FileType.NotFound

    def create(self, name: str, data: bytes) -> bool:
        if self.exists(name):
            return False
        self.fs.create_dir(self.path)
        self.replace(name, data)
        time.sleep(self.settle_s)
        return self.read(name) == data

    def replace(self, name: str, data: bytes) -> None:
        with self.fs.open_output_stream(f"{self.path}/{name}") as f:
            f.write(data)

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            self.fs.delete_file(f"{self.path}/{name}")


def store_at(run_dir: str) -> DirStore | ArrowStore:
    """The lease folder of the run directory `run_dir`: a path, or a URI pyarrow opens."""
    if "://" not in run_dir:
        return DirStore(Path(run_dir) / FOLDER)
    from pyarrow.fs import FileSystem

    fs, path = FileSystem.from_uri(run_dir)
    return ArrowStore(fs, f"{path}/{FOLDER}", f"{run_dir.rstrip('/')}/{FOLDER}")
