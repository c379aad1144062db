"""Every private name of torch that trainapp uses, in one place (as trainapp/launch/ray/private/ is for
Ray's): each is read here and nowhere else, and tests/test_torch_private.py checks on the installed torch
that every one of them still exists, so a torch upgrade that moves one fails that test by name instead of
a run on a cluster.

- `BatchNormBase`: the common base of BatchNorm1d/2d/3d and SyncBatchNorm (FSDP keeps those fp32 when it
  gathers parameters in bf16, trainapp/core/parallel/fsdp.py).
- `fsdp_param_groups`: FSDP2's parameter groups of a sharded unit, whose backward methods are where a
  rank waits for its peers (the per-rank timings bracket them).
- `scale_tensor`: the GradScaler's live scale tensor: `get_scale()` would sync the host every step.
- `onednn_bf16`: oneDNN's own answer whether it runs bf16 (it also says yes where it emulates it).
- `graph_breaks`: where and why dynamo broke a compiled function's graph (for `parallel.compile`'s
  one warning: torch logs breaks only with TORCH_LOGS set).
- `compiled_graphs`, `compile_cache_counts`: how many graphs dynamo compiled in this process (the
  carried compile cache is written again when the number grew), and how many of inductor's and
  AOTAutograd's lookups hit their caches.
- `inductor_cache_dir`: the local directory inductor caches its compiled code in (the carried compile
  cache is unpacked there).
- `cpp_compiler`: the C++ compiler inductor compiles CPU kernels with (`parallel.compile` checks it
  before anything is built).
- `loader_workers`, `unwatch_loader_workers`: a multi-process DataLoader iterator's worker processes,
  and taking them off torch's SIGCHLD check (which raises in the training process when a watched worker
  dies by a signal): trainapp/core/loader_start.py kills a worker stuck in its fork.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

PRIVATE = ("torch.nn.modules.batchnorm._BatchNorm", "GradScaler._scale",
           "torch.ops.mkldnn._is_mkldnn_bf16_supported", "FSDPModule._get_fsdp_state",
           "FSDPState._fsdp_param_groups", "torch._dynamo.utils.graph_break_reasons",
           "torch._inductor.cpp_builder.get_cpp_compiler", "torch._dynamo.utils.counters",
           "torch._inductor.runtime.cache_dir_utils.cache_dir", "_MultiProcessingDataLoaderIter._workers",
           "_MultiProcessingDataLoaderIter._worker_pids_set",
           "torch.utils.data._utils.signal_handling._remove_worker_pids")
"""Every private name read here; tests/test_torch_private.py checks each on the installed torch."""

__all__ = ["BatchNormBase", "PRIVATE", "compile_cache_counts", "compiled_graphs", "cpp_compiler",
           "fsdp_param_groups", "graph_breaks", "inductor_cache_dir", "loader_workers", "onednn_bf16",
           "scale_tensor", "unwatch_loader_workers"]


def fsdp_param_groups(unit: FSDPModule) -> list[Any]:
    """The FSDPParamGroups of one unit sharded with `fully_shard` (AttributeError/TypeError where this
    torch lays them out otherwise: the caller then times the waits another way)."""
    return list(unit._get_fsdp_state()._fsdp_param_groups)


def scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """The scaler's current loss scale, on the device, without a host sync."""
    assert scaler._scale is not None  # made by the scaler's first scale(), which comes first
    return scaler._scale


def onednn_bf16() -> bool:
    """oneDNN's answer whether this CPU runs bf16 (False where the build has no oneDNN)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def graph_breaks() -> list[str]:
    """Every graph break dynamo met in this process so far, as 'why (file:line)', first first ([] where
    this torch keeps them elsewhere)."""
    try:
        from torch._dynamo.utils import graph_break_reasons
    except ImportError:
        return []
    out = []
    for r in graph_break_reasons:
        where = f" ({r.user_stack[-1].filename}:{r.user_stack[-1].lineno})" if r.user_stack else ""
        out.append(f"{str(r.reason).strip().splitlines()[0]}{where}")
    return out


def cpp_compiler() -> tuple[str | None, list[str]]:
    """(the C++ compiler inductor would use on CPU, or None when none answers; the names it tries)."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler

    tried = [str(c) for c in inductor_config.cpp.cxx if c]
    try:
        return cpp_builder.get_cpp_compiler(), tried
    except InvalidCxxCompiler:
        return None, tried


def compiled_graphs() -> int:
    """The graphs dynamo compiled in this process so far (0 where this torch counts them elsewhere)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def inductor_cache_dir() -> str:
    """TORCHINDUCTOR_CACHE_DIR when set, else torch's default (a directory under the temp directory, per
    user): where inductor looks for compiled code before it compiles (made if missing)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def compile_cache_counts() -> dict[str, int]:
    """Cache hits and misses of inductor's FX-graph cache and AOTAutograd's cache in this process so far."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {"fxgraph_hits": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_misses": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
            "aot_misses": counters["aot_autograd"]["autograd_cache_miss"]}


def loader_workers(iterator: Any) -> list[Any]:
    """The worker processes (multiprocessing.Process) of a multi-process DataLoader iterator, by worker id."""
    return list(iterator._workers)


def unwatch_loader_workers(iterator: Any) -> None:
    """Take the iterator's workers off torch's SIGCHLD check, so that killing one raises nothing in this
    process; the iterator's own shutdown then skips that step."""
    from torch.utils.data._utils.signal_handling import _remove_worker_pids

    if iterator._worker_pids_set:
        _remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False
