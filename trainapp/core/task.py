"""The task seam: what trainapp does around the task's methods (trainapp/tasks/api.py). It calls
them in order (datasets, then the model, seeded), checks what they return the first time (a
one-line ConfigError naming `task.name` and what was wrong, exit 2), batches items and moves every
tensor of a batch to the device. The loop calls `loss` and `evaluate` through it and nothing else of
the task's.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from trainapp.config import ConfigError
from trainapp.core.items import DefaultCollate
from trainapp.streams.api import is_stream
from trainapp.tasks.api import TaskContext

if TYPE_CHECKING:
    from trainapp.group import DistContext

DOCS = "docs/your-own-model.md"


class MapStyle(Protocol):
    """A map-style dataset, as torch's samplers and loaders read one: a length and items by index (a
    torch Dataset with `__len__`, a list)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> Any: ...


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of `batch` on `device`: a tensor, or mappings (a dict, a Hugging Face BatchEncoding),
    tuples, namedtuples, lists and dataclasses of them; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, collections.abc.Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        kind: Any = type(batch)
        try:
            return kind(moved)  # the mapping's own type (its attributes), as default_collate keeps it
        except TypeError:
            return moved
    if isinstance(batch, (tuple, list)):
        items = [to_device(v, device) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: to_device(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


class BoundTask:
    """`task` (named `name` in the config) bound to a rank: `ctx` is what its methods are told."""

    def __init__(self, task: Any, name: str, ctx: TaskContext):
        self.task, self.name, self.ctx = task, name, ctx
        self._loss_checked = self._eval_checked = False
        self.random_items = bool(getattr(task, "random_items", True))
        """False when the task says its items draw nothing random (no per-item seeding then)."""
        custom = getattr(task, "collate", None)
        self.collate: Callable = custom if callable(custom) else DefaultCollate(name)
        has_state = callable(getattr(task, "state_dict", None))
        self.state = task if has_state else None
        """The task as a stateful part of the run, when it has state of its own."""

    def datasets(self) -> tuple[Any, Any]:
        """(train, val): each a map-style dataset or a stream (trainapp/streams/), checked."""
        out = self.task.datasets(self.ctx)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ConfigError(f"task.name={self.name!r}: datasets(ctx) returned {_what(out)}; it must return "
                              f"(train, val), two map-style datasets or streams ({DOCS})")
        for which, ds in zip(("train", "val"), out):
            if is_stream(ds):  # its shards are listed and checked once, where they are read (core/stream.py)
                continue
            if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
                raise ConfigError(f"task.name={self.name!r}: datasets(ctx) returned a {which} set without "
                                  f"len() and [index] ({_what(ds)}); return map-style datasets, such as a "
                                  "torch.utils.data.Dataset or a list, or a stream with shards() and "
                                  f"open(shard, start) ({DOCS})")
            if len(ds) == 0:
                raise ConfigError(f"task.name={self.name!r}: datasets(ctx) returned an empty {which} set")
        return out[0], out[1]

    def model(self) -> torch.nn.Module:
        torch.manual_seed(self.ctx.seed)  # the same initial weights on every rank and in every run
        model = self.task.model(self.ctx)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"task.name={self.name!r}: model(ctx) returned {_what(model)}; it must return "
                              "a torch.nn.Module")
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(f"task.name={self.name!r}: model(ctx) has no trainable parameters")
        return model.to(self.ctx.device)

    def param_groups(self, model: torch.nn.Module) -> list[dict[str, Any]] | None:
        groups = getattr(self.task, "param_groups", None)
        if not callable(groups):
            return None
        out = list(groups(model))
        if not out or not all(isinstance(g, dict) and "params" in g for g in out):
            raise ConfigError(f"task.name={self.name!r}: param_groups(model) must return a non-empty list of "
                              "dicts, each with a 'params' list (and options such as weight_decay, lr_mult)")
        return out

    def shard_units(self, model: torch.nn.Module) -> list[torch.nn.Module] | None:
        """The task's FSDP units (`shard_units(model)`, optional), or None when it names none."""
        units = getattr(self.task, "shard_units", None)
        if not callable(units):
            return None
        out = list(units(model))
        inside = {id(m) for m in model.modules()}
        if not out or not all(isinstance(m, torch.nn.Module) and id(m) in inside and m is not model
                              for m in out):
            raise ConfigError(f"task.name={self.name!r}: shard_units(model) must return a non-empty list of "
                              "the model's own submodules (the units FSDP shards, e.g. its transformer "
                              "blocks)")
        return out

    def to_device(self, batch: Any) -> Any:
        return to_device(batch, self.ctx.device)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = self.task.loss(model, batch)
        if not self._loss_checked:  # the first step only: checking costs nothing after
            self._check_loss(loss)
        return loss

    def _check_loss(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(f"task.name={self.name!r}: loss(model, batch) returned {_what(loss)}; it must "
                              "return a scalar tensor")
        if loss.ndim != 0:
            raise ConfigError(f"task.name={self.name!r}: loss(model, batch) returned a tensor of shape "
                              f"{tuple(loss.shape)}; it must return a scalar (reduce it, e.g. with .mean())")
        if not loss.requires_grad:
            raise ConfigError(f"task.name={self.name!r}: loss(model, batch) returned a tensor without grad; "
                              "compute it from the model's output, without .item(), .detach() or "
                              "torch.no_grad()")
        self._loss_checked = True

    def evaluate(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        sums = self.task.evaluate(model, batch)
        if not self._eval_checked:
            if not isinstance(sums, dict) or "count" not in sums:
                got = f"keys {sorted(sums)}" if isinstance(sums, dict) else _what(sums)
                raise ConfigError(f"task.name={self.name!r}: evaluate(model, batch) returned {got}; it must "
                                  "return a dict of sums over the batch with a 'count' entry "
                                  "(samples or tokens)")
            for key, value in sums.items():
                if not (isinstance(key, str) and key.isidentifier()):
                    raise ConfigError(f"task.name={self.name!r}: evaluate(model, batch) returned the key "
                                      f"{key!r}; keys are names (letters, digits, _)")
                if not (isinstance(value, (int, float))
                        or (isinstance(value, torch.Tensor) and value.numel() == 1)):
                    raise ConfigError(f"task.name={self.name!r}: evaluate(model, batch)[{key!r}] is "
                                      f"{_what(value)}; each entry is a number or a one-element tensor "
                                      "(a sum over the batch)")
            self._eval_checked = True
        return sums


def _what(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}" if not isinstance(value, torch.Tensor) else \
        f"a tensor of shape {tuple(value.shape)}"


def bind(task: Any, ctx: DistContext, *, name: str, seed: int, run_dir: str | Path,
         steps_done: Callable[[], int] = lambda: 0) -> BoundTask:
    """`task` (made: trainapp/tasks/load.py's `resolve` makes the one `task.name` names) bound to the rank
    of `ctx` (a DistContext); `name`: `task.name`, for its errors; `seed` and `run_dir`: the run's."""
    tctx = TaskContext(seed=seed, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device,
                       run_dir=Path(run_dir), local_rank=ctx.local_rank, barrier=ctx.files.barrier,
                       steps_done=steps_done)
    return BoundTask(task, name, tctx)
