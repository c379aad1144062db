"""torch.compile of the units (`parallel.compile=true`): each unit's `forward` in place, as torchtitan
compiles each transformer block, so that

- the state dict's keys stay the module's own (no `_orig_mod.` prefix): snapshots, exports and
  `init.from` are those of an eager run;
- hooks stay eager: FSDP's gathers and the per-rank timings' hooks run around the compiled code;
- every unit's backward is a graph of its own, so a unit's gradients are ready when its backward ends,
  and DDP's buckets and FSDP's reduce-scatters overlap the rest of the backward as they do eagerly.
  (DDP's graph-break optimizer, which splits one whole-model graph at bucket boundaries, is not needed:
  there is no whole-model graph.)

Units of the same class share their compiled code (one graph per distinct unit, not per instance).
A part of a model that should stay eager is marked by the task with torch's own
`torch.compiler.disable` (docs/compile.md). Graph breaks are allowed; the first is named in one warning
after the first step."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging

import torch

from trainapp.config import ConfigError
from trainapp.core import torch_private

log = logging.getLogger(__name__)


def check_compiler(device: torch.device) -> str:
    """The compiler inductor will use on `device` (C++ on CPU, Triton on CUDA); ConfigError naming
    what is missing otherwise, before anything is built."""
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise ConfigError("parallel.compile=true: inductor needs Triton on CUDA and this torch has "
                              "none; install the torch wheel with its triton, or set parallel.compile=false")
        return f"triton {importlib.metadata.version('triton')}"
    found, tried = torch_private.cpp_compiler()
    if found is None:
        raise ConfigError(f"parallel.compile=true: inductor needs a C++ compiler on CPU and none answers "
                          f"({', '.join(tried)}; the CXX environment variable names another): install one "
                          "(Debian: apt-get install g++), or set parallel.compile=false")
    return found


def compile_units(units: list[torch.nn.Module]) -> None:
    for unit in units:
        unit.forward = torch.compile(unit.forward)


def first_step_line() -> str:
    """What compiling the first step took from the caches: the line rank 0 logs after it."""
    c = torch_private.compile_cache_counts()
    return (f"parallel.compile: {torch_private.compiled_graphs()} graphs by the first step; inductor's cache "
            f"{c.get('fxgraph_hits', 0)} hits, {c.get('fxgraph_misses', 0)} compiled; AOTAutograd's "
            f"{c.get('aot_hits', 0)} hits, {c.get('aot_misses', 0)} compiled")


def warn_first_break() -> None:
    """One warning naming the first graph break dynamo met so far, if any: the model still trains, a
    part of it eagerly."""
    breaks = torch_private.graph_breaks()
    if breaks:
        log.warning("parallel.compile: the model does not compile as one graph per unit (%d graph break%s); "
                    "the first: %s. It trains with the breaks; docs/compile.md says how to find and mend "
                    "them", len(breaks), "" if len(breaks) == 1 else "s", breaks[0])
