"""The slow snapshot write drill (`drill.snapshot_write_delay_s`): a disk slow enough that a write takes
that long, for the tests that show a slow write is not taken for a hang and that a stop or a lost rank in
the middle of one leaves every snapshot whole. It wraps the snapshot writer's `Disk` seam
(trainapp/snapshots/store.py): without shards, a pause between the state file and the meta file that
completes the snapshot; with shards (FSDP), torch.distributed.checkpoint's files written slowly. Either
way it beats the hang watchdog as a real write does: slow, not hung."""

from __future__ import annotations

import contextlib
import os
import time
from typing import IO, TYPE_CHECKING, Any, Callable, Generator

from trainapp.snapshots.files import local_bytes
from trainapp.snapshots.store import Disk

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem
    from typing_extensions import Buffer


class SlowDisk(Disk):
    """Every snapshot written over about `delay_s` seconds."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    @classmethod
    def drill(cls, delay_s: float) -> SlowDisk | None:
        """The drill as configured: None (the plain disk) when it is off."""
        return cls(delay_s) if delay_s > 0 else None

    def before_meta(self, progress: Callable[[], None]) -> None:
        end = time.monotonic() + self.delay_s
        while time.monotonic() < end:  # a slow write, not a hung one: it beats as a real one does
            time.sleep(max(0.0, min(0.5, end - time.monotonic())))
            progress()

    def shard_writer(self, writer: dcp.FileSystemWriter, shards: dict[str, Any]) -> dcp.FileSystemWriter:
        writer.fs = slow_file_system(local_bytes(shards), self.delay_s)
        return writer


def slow_file_system(total_bytes: int, seconds: float) -> FileSystem:
    """torch.distributed.checkpoint's file system as a slow disk would be, writing this rank's
    `total_bytes` over about `seconds` in pieces of a tenth of a second each, so that the files grow the
    whole time: a slow write, not a hung one."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    rate = max(total_bytes, 1) / seconds
    piece = max(4096, int(rate / 10))
    clock = {"start": time.monotonic(), "written": 0}

    class Stream:
        def __init__(self, raw: IO[bytes]) -> None:
            self.raw = raw

        def __getattr__(self, name: str) -> Any:  # tell, flush, fileno (DCP fsyncs it), close
            return getattr(self.raw, name)

        def write(self, b: Buffer) -> int:
            view = memoryview(b).cast("B")
            for at in range(0, len(view), piece):
                self.raw.write(view[at:at + piece])
                self.raw.flush()  # on disk now, as a slow disk would show it
                clock["written"] += len(view[at:at + piece])
                time.sleep(max(0.0, clock["start"] + clock["written"] / rate - time.monotonic()))
            return len(view)

    class SlowFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
            # Yields DCP's own file, or Stream in its place (a stand-in, no IOBase: Any). DCP opens the
            # file with open(): a binary file, which its annotation calls an IOBase.
            with super().create_stream(path, mode) as raw:
                yield Stream(raw) if "w" in mode else raw  # type: ignore[arg-type]

    return SlowFileSystem()
