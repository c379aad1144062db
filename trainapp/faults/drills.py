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
  (trainapp/faults/slow_disk.py), handed to the snapshot manager.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch

from trainapp.config import DrillSection
from trainapp.errors import ConfigError
from trainapp.faults.heartbeat import Heartbeat

log = logging.getLogger(__name__)


# What the slow-rank drill reaches of the run's parts (trainapp/core/build.py's Parts, a layer above).
class _Batches(Protocol):
    def steps_from(self, start: int) -> int: ...

    def epoch(self, epoch: int, start: int) -> Iterator[Any]: ...


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

    def epoch(self, epoch: int, start: int) -> Iterator[Any]:
        for batch in self.batches.epoch(epoch, start):
            time.sleep(self.pause_s)
            yield batch


class Drills:
    """This rank's drills. Raises ConfigError when a drill names a rank the run does not have."""

    def __init__(self, cfg: DrillSection, rank: int, world_size: int, run_dir: str | Path,
                 heartbeat: Heartbeat):
        step_drill = any(at is not None for at in (cfg.kill_at_step, cfg.hang_at_step, cfg.oom_at_step))
        if step_drill and cfg.rank >= world_size:
            raise ConfigError(f"drill.rank={cfg.rank}: must be < world size {world_size}")
        if cfg.slow_rank is not None and cfg.slow_rank >= world_size:
            raise ConfigError(f"drill.slow_rank={cfg.slow_rank}: must be < world size {world_size}")
        self.cfg, self.rank, self.run_dir, self.heartbeat = cfg, rank, Path(run_dir), heartbeat
        self.at_step = {at: name for name, at in (("kill", cfg.kill_at_step), ("hang", cfg.hang_at_step),
                                                  ("oom", cfg.oom_at_step))
                        if at is not None and cfg.rank == rank}
        """This rank's step drills by step: one dict lookup per step."""

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
