"""The public contract between trainapp and a task, the user's part of a run (docs/your-own-model.md).

A task is any object with the four methods of `Task`; the optional ones are used where present.
trainapp owns everything else: batching and moving batches to the device, autocast, gradient
accumulation and scaling, clipping, DDP, the optimizer and schedule, evaluation across ranks,
snapshots and resume, and every fault it survives.

`TaskContext` and `Task` are exported by trainapp.tasks; `Task` is for type checkers and documentation
(`isinstance(obj, Task)` checks only that the four methods exist).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is not imported with the contract: the Ray driver checks a task without it
    import torch

REQUIRED = ("datasets", "model", "loss", "evaluate")
"""The methods every task has."""
OPTIONAL = ("collate", "state_dict", "load_state_dict", "param_groups", "shard_units", "export")
"""The methods a task may have (None, or absent, is the same as not having one)."""
ATTRIBUTES = ("random_items",)
"""The plain attributes a task may have: `random_items` (default true): whether its train set's
`__getitem__` draws random numbers, which trainapp then seeds per (seed, epoch, index); false spares the
seeding for fixed items."""


@dataclass(frozen=True)
class TaskContext:
    """What a task's methods are told about the run."""

    seed: int
    """The run's `seed`: derive any randomness of the task's own from it."""
    rank: int
    """This process's rank, 0 .. world_size - 1."""
    world_size: int
    """Processes training together."""
    device: torch.device
    """Where this rank trains; trainapp moves every batch there before `loss` and `evaluate`."""
    run_dir: Path
    """The run directory (`run.dir`): shared by the ranks, kept across restarts."""
    local_rank: int = 0
    """This process's rank on its node."""
    barrier: Callable[[], None] = field(default=lambda: None, repr=False)
    """Wait for every rank (a no-op alone): rank 0 prepares a file, the others wait, then read it."""
    steps_done: Callable[[], int] = field(default=lambda: 0, repr=False)
    """Optimizer steps done so far (in `loss`: the step being trained is steps_done() + 1), across
    restarts: for a curriculum, a loss schedule, or a record of what each step saw."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@runtime_checkable
class Task(Protocol):
    """The user's part of a run. Items of the datasets may be a tensor, a tuple or a dict of tensors."""

    def datasets(self, ctx: TaskContext) -> tuple[Any, Any]:
        """(train, val): map-style datasets (`__len__` and `__getitem__`), or streams of shards
        (`shards()` and `open(shard, start)`: trainapp.streams.Stream, whose position trainapp owns).
        Randomness drawn while an item is read from torch's, numpy's or Python's generator is seeded per
        (seed, epoch, index), or per (seed, epoch, shard, item), by trainapp, so a resumed run sees the same
        items whatever the data loader workers."""

    def model(self, ctx: TaskContext) -> torch.nn.Module:
        """The model, on any device (trainapp moves it). Called with torch seeded from `seed`, so every
        rank and every run with that seed starts from the same weights."""

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The training loss of `batch` (on the device) as a scalar with grad, computed inside trainapp's
        autocast; `model` is the wrapped model to call (DDP when distributed)."""

    def evaluate(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Sums over `batch` (no grad, model in eval mode), with a `count` entry (samples or tokens).
        trainapp sums every entry over batches and ranks and records `val_<name>` = sum / count."""


# The optional methods, for reference (a Protocol's members would all be required):
#   collate(items: list) -> batch                       instead of torch's default_collate
#   state_dict() -> dict / load_state_dict(state)       the task's own state, in every snapshot
#   param_groups(model) -> list[dict]                   optimizer groups ({"params": [...], options})
#   shard_units(model) -> list[nn.Module]               the submodules FSDP shards as units
#                                                       (parallel.strategy=fsdp)
#   export(model, out_dir: Path)                        its own format beside model.safetensors in the export
#                                                       directory (e.g. save_pretrained; docs/export.md)
