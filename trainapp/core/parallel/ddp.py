"""`parallel.strategy=ddp` with more than one rank: every rank holds the whole model and
DistributedDataParallel all-reduces the gradients. The snapshot is loaded into the plain module before
it is wrapped (trainapp/core/build.py), so DDP's first broadcast starts every rank from it."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainapp.core.parallel.strategy import Strategy
from trainapp.observe.timings import PhaseClock


class Replicated(Strategy):
    name = "ddp"

    ddp: DDP | None = None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        self.ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
        self.train_model = self.ddp
        return self.ddp

    def time_waits(self, clock: PhaseClock) -> None:
        if self.ddp is not None:
            clock.attach(self.ddp)  # its comm hook: when the last bucket is handed over, backward is done

    def no_sync(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        return self.ddp.no_sync() if self.ddp is not None and not sync else contextlib.nullcontext()
