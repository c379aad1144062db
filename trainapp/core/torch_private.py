"""Every private name of torch that trainapp uses, in one place (as trainapp/launch/ray/private/ is for
Ray's): each is read here and nowhere else, and tests/test_torch_private.py checks on the installed torch
that every one of them still exists, so a torch upgrade that moves one fails that test by name instead of
a run on a cluster.

- `BatchNormBase`: the common base of BatchNorm1d/2d/3d and SyncBatchNorm (FSDP keeps those fp32 when it
  gathers parameters in bf16, trainapp/core/parallel.py).
- `fsdp_param_groups`: FSDP2's parameter groups of a sharded unit, whose backward methods are where a
  rank waits for its peers (the per-rank timings bracket them).
- `scale_tensor`: the GradScaler's live scale tensor: `get_scale()` would sync the host every step.
- `onednn_bf16`: oneDNN's own answer whether it runs bf16 (it also says yes where it emulates it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

PRIVATE = ("torch.nn.modules.batchnorm._BatchNorm", "GradScaler._scale",
           "torch.ops.mkldnn._is_mkldnn_bf16_supported", "FSDPModule._get_fsdp_state",
           "FSDPState._fsdp_param_groups")
"""Every private name read here; tests/test_torch_private.py checks each on the installed torch."""

__all__ = ["BatchNormBase", "PRIVATE", "fsdp_param_groups", "onednn_bf16", "scale_tensor"]


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
