"""The units of a model: the modules that FSDP shards one by one and that activation checkpointing and
compile treat as one piece each (`parallel.fsdp_units`, the task's `shard_units`, or the children)."""

from __future__ import annotations

from typing import Any

import torch

from trainapp.config import ConfigError


def units(model: torch.nn.Module, names: list[str], task: Any = None) -> list[torch.nn.Module]:
    """The modules sharded as units, outermost first: by class name (`parallel.fsdp_units`), else the
    task's `shard_units(model)`, else every child of the model that holds parameters, the items of a
    Sequential or ModuleList child each a unit of its own (a transformer's blocks)."""
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        missing = sorted(set(names) - {type(m).__name__ for m in found})
        if missing:
            have = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(f"parallel.fsdp_units={names}: no module of class {', '.join(missing)} in the "
                              f"model; its module classes are {', '.join(have)}")
        return found
    chosen = task.shard_units(model) if task is not None and hasattr(task, "shard_units") else None
    if chosen is not None:
        return chosen
    # A parameter tied to another module's (an embedding shared with the output layer) must stay in one
    # FSDP group: a unit holding one is left to the model's own group.
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    out: list[torch.nn.Module] = []
    for child in model.children():
        items = (list(child.children()) if isinstance(child, (torch.nn.Sequential, torch.nn.ModuleList))
                 else [child])
        out.extend(m for m in items if any(True for _ in m.parameters())
                   and all(counts[id(p)] == 1 for p in m.parameters()))
    return out
