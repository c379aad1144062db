"""The strategy: how the model is readied for training and spread over the ranks, in one object, so
that `build` and the loop ask it instead of branching on DDP or FSDP.

`prepare` applies, in torchtitan's order, activation checkpointing, compile and the strategy's own
placement (FSDP shards here; DDP wraps later, in `wrap`, after the snapshot was loaded into the plain
module). The rest is what differs per strategy at run time: which state objects a snapshot saves, the
context of a micro-batch's backward (`no_sync`), what follows the optimizer step, how waits for peers
are timed, how evaluation walks the validation set, and whether a snapshot carries a digest of the
whole model."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from trainapp.config import ParallelSection
from trainapp.core.parallel import checkpointing, compiling
from trainapp.core.parallel.compile_cache import CompileCache
from trainapp.core.parallel.units import units
from trainapp.snapshots.store import params_sha256

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from trainapp.group import DistContext
    from trainapp.observe.timings import PhaseClock

log = logging.getLogger(__name__)


class Strategy:
    """The base: one whole model per rank, nothing to synchronise (a run alone); DDP and FSDP add to it
    (trainapp/core/parallel/ddp.py, fsdp.py)."""

    name = "ddp"
    sharded = False
    """Each rank holds a shard of the model: every forward is a collective, and snapshots are sharded."""
    interruptible_eval = True
    """A preemption notice may cut an evaluation short (a sharded model's ranks must finish it together)."""

    def __init__(self, cfg: ParallelSection, ctx: DistContext, task: Any = None,
                 run_dir: str | Path | None = None) -> None:
        """`run_dir`: where the compile cache is carried (none without it)."""
        self.cfg, self.ctx, self.task = cfg, ctx, task
        self.train_model: torch.nn.Module | None = None
        """What the step calls, once `wrap` made it."""
        self.described: dict[str, Any] = {"strategy": self.name}
        """What the start record says of it (`parallel`)."""
        self._breaks_told = not cfg.compile
        self.cache: CompileCache | None = None
        if cfg.compile:  # before anything is built: a missing compiler is a config error, said at once
            self.described["compile"] = {"compiler": compiling.check_compiler(ctx.device)}
            if run_dir is not None:  # before anything is compiled
                self.cache = CompileCache(run_dir, ctx.device, ctx.is_main)
                self.described["compile"]["cache"] = self.cache.load()

    def prepare(self, model: torch.nn.Module, copy: torch.nn.Module | None = None,
                dtype: torch.dtype | None = None) -> None:
        """Before the optimizer is made: activation checkpointing, compile, then the strategy's placement
        of `model` and of `copy` (the EMA copy, made before: it stays eager, it is only evaluated)."""
        pieces = units(model, self.cfg.fsdp_units, self.task) or [model]
        if self.cfg.activation_checkpoint == "full":
            checkpointing.checkpoint(pieces)
            self.described["activation_checkpoint"] = {"mode": "full", "units": len(pieces)}
        if self.cfg.compile:
            compiling.compile_units(pieces)
            names = {id(m): n or "(the model)" for n, m in model.named_modules()}
            self.described["compile"].update(units=[names[id(m)] for m in pieces], how="each unit's forward")
        self.place(model, copy, dtype)

    def place(self, model: torch.nn.Module, copy: torch.nn.Module | None, dtype: torch.dtype | None) -> None:
        """The strategy's step before the optimizer (FSDP: sharding)."""

    def state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              ema: torch.nn.Module | None) -> dict[str, Any]:
        """The snapshot's model, optimizer and EMA parts (trainapp/core/state.py)."""
        return {"model": model, "optimizer": optimizer, "ema": ema}

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """After the resume: what the step calls."""
        self.train_model = model
        return model

    def time_waits(self, clock: PhaseClock) -> None:
        """Hooks that let the phase clock count waits for peers as comm."""

    def no_sync(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        """The context of one micro-batch's backward: gradients reduced across ranks only when `sync` (the
        last micro-batch of the step)."""
        return contextlib.nullcontext()

    def after_step(self, model: torch.nn.Module, clock: PhaseClock) -> None:
        """After the optimizer step, before the EMA update. With compile on: the first time, the first
        graph break, if any, in one warning; every time, the carried cache written if more was compiled."""
        if not self._breaks_told:
            self._breaks_told = True
            if self.ctx.is_main:
                log.info("%s", compiling.first_step_line())
                compiling.warn_first_break()
        if self.cache is not None:
            self.cache.save_if_grown()

    def eval_batches(self, loader: DataLoader) -> Iterator[tuple[bool, Any]]:
        """(padding, batch) pairs: this rank's validation batches (padding ones have results dropped).
        After the last one, the carried compile cache is written if evaluation compiled more."""
        yield from self._eval_batches(loader)
        if self.cache is not None:
            self.cache.save_if_grown()

    def _eval_batches(self, loader: DataLoader) -> Iterator[tuple[bool, Any]]:
        return ((False, b) for b in loader)

    def digest(self, model: torch.nn.Module) -> dict[str, str]:
        """What a snapshot's meta says of the whole model (rank 0)."""
        return {"params_sha256": params_sha256(model)}
