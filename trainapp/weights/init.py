"""`init.from`: a new run's model starts from weights someone trained (an export, a safetensors file, another
run's snapshot), not from the task's initialisation. Only the weights: the optimizer, schedule, data
position and random generators start fresh. A run that has snapshots of its own resumes from them and
never reads `init.from` again (trainapp/core/build.py decides).

Every rank loads the whole model before it is wrapped or sharded (trainapp/core/build.py builds the
whole model on every rank first), a batch of tensors at a time. The names, shapes and dtypes are
checked against the model before anything is read: a source that does not fit is one line naming the
first few names that are missing, unexpected or of another shape, and the two ways out
(`init.exclude` for the parts the task made new, `init.strict=false` to take what fits).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainapp.errors import ConfigError
from trainapp.weights.artifact import tied
from trainapp.weights.sources import Source, open_source

log = logging.getLogger(__name__)
SHOWN = 4
"""Names listed per kind of misfit in the one line."""


def _names(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(sorted(names)[:SHOWN]) + more


def _excluded(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p if p.endswith(".") else p + ".") for p in prefixes)


def fit(model: torch.nn.Module, source: Source, exclude: list[str], strict: bool,
        setting: str = "init.from") -> tuple[list[str], list[str]]:
    """(names to load, names skipped) of `source` into `model`; ConfigError when they do not fit and
    `strict`. Tied names the source stores once count as present (safetensors stores them once)."""
    target = model.state_dict()
    ties = tied(target)
    have = source.entries
    wanted = [n for n in target if not _excluded(n, exclude)]
    present = {n for n in wanted if n in have or ties.get(n) in have}
    missing = [n for n in wanted if n not in present]
    unexpected = [n for n in have if n not in target and not _excluded(n, exclude)]
    shape = [n for n in wanted if n in have and tuple(target[n].shape) != have[n].shape]
    if strict and (missing or unexpected or shape):
        parts = [f"{len(missing)} missing ({_names(missing)})" if missing else "",
                 f"{len(unexpected)} unexpected ({_names(unexpected)})" if unexpected else "",
                 "another shape: " + ", ".join(f"{n} {tuple(have[n].shape)} vs the model's "
                                              f"{tuple(target[n].shape)}"
                                              for n in sorted(shape)[:SHOWN]) if shape else ""]
        raise ConfigError(f"{setting}={source.path}: its weights do not fit the task's model: "
                          f"{'; '.join(p for p in parts if p)}; leave the parts the task makes new out with "
                          "init.exclude=[prefix, ...], or load what fits with init.strict=false")
    load = [n for n in wanted if n in have and n not in shape]
    return load, [n for n in wanted if n not in load and n not in ties]


@torch.no_grad()
def load_into(model: torch.nn.Module, source: Source, names: list[str]) -> None:
    """Copy the `names` of `source` into `model`'s tensors (a batch at a time; cast to the model's dtype);
    a tied name the source stores once fills every name of its tensor (they are one tensor)."""
    target = model.state_dict()
    for batch in source.batches(names):
        for name, value in batch.items():
            target[name].copy_(value)
        batch.clear()  # before the next batch is read: one batch in memory at a time


def apply(model: torch.nn.Module, path: str, exclude: list[str], strict: bool) -> dict[str, Any]:
    """`init.from=path` into `model` (on every rank, before it is wrapped); what the records say of it."""
    source = open_source(path, setting="init.from")
    names, skipped = fit(model, source, exclude, strict)
    if not names:
        raise ConfigError(f"init.from={path}: no weight of it fits the task's model (none has the model's "
                          "names and shapes); is it the model of another task?")
    load_into(model, source, names)
    if skipped:
        log.warning("init.from=%s: %d of the model's tensors keep the task's initialisation (%s)", path,
                    len(skipped), _names(skipped))
    return {**source.record, "loaded": len(names), "kept": len(skipped), "exclude": list(exclude),
            "strict": strict}
