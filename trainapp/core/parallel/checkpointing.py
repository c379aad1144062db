"""Activation checkpointing (`parallel.activation_checkpoint=full`): each unit's training forward keeps
only its inputs for the backward, which runs the unit's forward again to get what it needs.

Applied to the unit's `forward` in place (an attribute of the module, not a wrapper module): the state
dict's keys, the snapshots and `init.from` stay the same, and FSDP's hooks, which run around
`forward`, still gather a unit's parameters for its forward and again for the recomputation.
torch.utils.checkpoint, non-reentrant: it restores the RNG state for the recomputation (the same dropout
masks), so the run is bitwise the run without it."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.utils.checkpoint


def checkpoint(units: list[torch.nn.Module]) -> None:
    """Every unit's forward checkpointed while gradients are on (evaluation runs it plainly)."""
    for unit in units:
        unit.forward = _checkpointed(unit.forward)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
