"""Drills: faults caused on purpose (`drill.*`), so that surviving each one is shown with the real fault.

They plug into the run from outside the loop:

- the step drills (`kill_at_step`, `hang_at_step`, `oom_at_step`) are a hook the loop calls after
  each step: rank `drill.rank` SIGKILLs itself, stops making progress (its training thread sleeps, as
  a stuck data loader would) or raises `torch.OutOfMemoryError`, once: a marker file in `run.dir`
  keeps it from firing again after the restart;
- the slow-rank drill (`slow_rank`, `slow_ms`, `slow_phase`) is attached to the parts: a pause after
  each batch is fetched (data), a forward hook that pauses between forward and backward (compute, as
  a slow device would be), or an optimizer step hook (optim);
- the slow snapshot write (`snapshot_write_delay_s`) is a slow disk under the snapshot writer
  (`Drills.disk`, handed to the snapshot manager): without shards, a pause between the state file and
  the meta file that completes the snapshot; with shards (FSDP), torch.distributed.checkpoint's files
  written slowly. Either way it beats the hang watchdog as a real write does: slow, not hung. It shows
  that a slow write is not taken for a hang and that a stop or a lost rank in the middle of one leaves
  every snapshot whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Generator, Iterator, Protocol

import torch

from trainapp.config import DrillSection
from trainapp.errors import ConfigError
from trainapp.faults.heartbeat import Heartbeat
from trainapp.snapshots.files import local_bytes
from trainapp.snapshots.store import Disk

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem
    from typing_extensions import Buffer

log = logging.getLogger(__name__)


# What the slow-rank drill reaches of the run's parts (trainapp/core/build.py's Parts, a layer above).
class _Batches(Protocol):
    def steps_from(self, start: int) -> int: ...

    def epoch(self, epoch: int, start: int) -> Iterator[Any]: ...

    @property
    def account(self) -> dict[str, Any] | None: ...


class _Parts(Protocol):
    batches: _Batches

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...


class _SlowBatches:
    """An epoch's batches, each one `pause_s` late."""

    def __init__(self, batches: _Batches, pause_s: float) -> None:
        self.batches, self.pause_s = batches, pause_s

    def steps_from(self, start: int) -> int:
        return self.batches.steps_from(start)

    @property
    def account(self) -> dict[str, Any] | None:
        return self.batches.account

    def epoch(self, epoch: int, start: int) -> Iterator[Any]:
        for batch in self.batches.epoch(epoch, start):
            time.sleep(self.pause_s)
            yield batch


class Drills:
    """This rank's drills. Raises ConfigError when a drill names a rank the run does not have."""

    def __init__(self, cfg: DrillSection, rank: int, world_size: int, run_dir: str | Path,
                 heartbeat: Heartbeat):
        step_drill = any(at is not None for at in (cfg.kill_at_step, cfg.hang_at_step, cfg.oom_at_step,
                                                   cfg.kill_in_memory_copy_at_step))
        if step_drill and cfg.rank >= world_size:
            raise ConfigError(f"drill.rank={cfg.rank}: must be < world size {world_size}")
        if cfg.slow_rank is not None and cfg.slow_rank >= world_size:
            raise ConfigError(f"drill.slow_rank={cfg.slow_rank}: must be < world size {world_size}")
        self.cfg, self.rank, self.run_dir, self.heartbeat = cfg, rank, Path(run_dir), heartbeat
        self.at_step = {at: name for name, at in (("kill", cfg.kill_at_step), ("hang", cfg.hang_at_step),
                                                  ("oom", cfg.oom_at_step))
                        if at is not None and cfg.rank == rank}
        """This rank's step drills by step: one dict lookup per step."""
        self.disk = SlowDisk(cfg.snapshot_write_delay_s) if cfg.snapshot_write_delay_s > 0 else None
        """The snapshot writer's disk: a slow one while the slow-write drill is on, else None (plain)."""

    def attach(self, parts: _Parts) -> None:
        """The slow-rank drill on this rank, hooked into its parts."""
        if self.cfg.slow_rank != self.rank:
            return
        pause_s = self.cfg.slow_ms / 1000
        if self.cfg.slow_phase == "data":
            parts.batches = _SlowBatches(parts.batches, pause_s)
        elif self.cfg.slow_phase == "compute":
            # Between forward and backward, in training only.
            def pause(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
                if module.training:
                    time.sleep(pause_s)

            parts.model.register_forward_hook(pause)
        else:
            parts.optimizer.register_step_post_hook(lambda opt, args, kwargs: time.sleep(pause_s))

    def after_step(self, step: int) -> None:
        what = self.at_step.get(step)
        if what is None or not self._first_time(what, step):
            return
        if what == "hang":
            log.warning("fault drill: rank %d stops making progress after step %d (a stuck data loader)",
                        self.rank, step)
            self.heartbeat.set_phase("data")
            while True:
                time.sleep(3600)
        if what == "oom":
            self.heartbeat.set_phase("compute")
            raise torch.OutOfMemoryError(f"fault drill (drill.oom_at_step={step}): rank {self.rank} ran out "
                                         "of memory")
        log.warning("fault drill: rank %d kills itself with SIGKILL at step %d", self.rank, step)
        os.kill(os.getpid(), signal.SIGKILL)

    def in_memory_copy(self, step: int) -> None:
        """Halfway through this rank's memory-tier copy of `step` (trainapp/snapshots/memory_slots.py): the
        kill of `drill.kill_in_memory_copy_at_step`, once."""
        if (self.cfg.kill_in_memory_copy_at_step == step and self.cfg.rank == self.rank
                and self._first_time("memcopy", step)):
            log.warning("fault drill: rank %d kills itself with SIGKILL halfway through its memory copy of "
                        "step %d", self.rank, step)
            os.kill(os.getpid(), signal.SIGKILL)

    def _first_time(self, what: str, step: int) -> bool:
        """Leave the drill's marker in run.dir; False when it is there already (fired before this restart)."""
        marker = self.run_dir / (f"fault-fired-{'' if what == 'kill' else what + '-'}"
                                 f"step{step}-rank{self.rank}")
        if marker.exists():
            return False
        marker.parent.mkdir(parents=True, exist_ok=True)
        with open(marker, "w") as fh:
            fh.write(f"{time.time()}\n")
            fh.flush()
            os.fsync(fh.fileno())
        return True


class SlowDisk(Disk):
    """Every snapshot written over about `delay_s` seconds."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

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
