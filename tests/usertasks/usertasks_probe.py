"""Tasks a user might write, good and bad, for tests/test_tasks.py: none of them is trainapp's. Each bad
one breaks exactly one rule of the contract (docs/your-own-model.md)."""

from __future__ import annotations

import torch
from torch import nn

NOT_CALLABLE = 3


class Good:
    """A linear regression on rows made from the seed; items are (x, y) tuples."""

    def __init__(self, rows: int = 256):
        if rows < 16:
            raise ValueError(f"rows={rows}: need at least 16")
        self.rows = rows

    def datasets(self, ctx):
        g = torch.Generator().manual_seed(ctx.seed)
        x = torch.randn(self.rows, 4, generator=g)
        y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
        return list(zip(x, y)), list(zip(x[:32], y[:32]))

    def model(self, ctx):
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1), nn.Flatten(0))

    def loss(self, model, batch):
        x, y = batch
        return ((model(x).float() - y) ** 2).mean()

    def evaluate(self, model, batch):
        x, y = batch
        return {"mse": ((model(x).float() - y) ** 2).sum(), "count": len(y)}


def make(rows: int = 256) -> Good:
    return Good(rows)


class Needy(Good):
    def __init__(self, width: int):
        super().__init__()
        self.width = width


class NoEvaluate:
    datasets, model, loss = Good.datasets, Good.model, Good.loss

    def __init__(self):
        self.rows = 64


class UnitsList(Good):
    shard_units = ["blocks"]  # meant as fsdp_units: a list where a method belongs


class NoLen(Good):
    def datasets(self, ctx):
        train, val = super().datasets(ctx)
        return (item for item in train), val


class VectorLoss(Good):
    def loss(self, model, batch):
        x, y = batch
        return (model(x).float() - y) ** 2


class DetachedLoss(Good):
    def loss(self, model, batch):
        return super().loss(model, batch).detach()


class NoCount(Good):
    def evaluate(self, model, batch):
        return {"mse": super().evaluate(model, batch)["mse"]}


class Ragged(Good):
    def datasets(self, ctx):
        return [torch.zeros(1 + i % 3) for i in range(64)], [torch.zeros(2)] * 8


class Counting(Good):
    """Task state of its own: the micro-batches its loss has seen, saved in every snapshot."""

    def __init__(self, rows: int = 256, fail_at: int = 0):
        super().__init__(rows)
        self.seen, self.fail_at = 0, fail_at

    def loss(self, model, batch):
        self.seen += 1
        if self.seen == self.fail_at:
            raise RuntimeError(f"user bug in loss at call {self.seen}")
        return super().loss(model, batch)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


class NumpyState(Good):
    """A running mean of the inputs kept as a numpy array in its state: torch.save writes it, a snapshot's
    torch.load(weights_only=True) would not read it back."""

    def __init__(self, rows: int = 256):
        super().__init__(rows)
        import numpy as np

        self.mean = np.zeros(4)

    def state_dict(self):
        return {"seen": 0, "norm": {"mean": self.mean}}

    def load_state_dict(self, state):
        self.mean = state["norm"]["mean"]


class _Tagged(nn.Linear):
    """A layer with extra state of its own class, as some model libraries keep (a quantizer's settings)."""

    def get_extra_state(self):
        import dataclasses

        return dataclasses.make_dataclass("Settings", ["bits"])(8)

    def set_extra_state(self, state):
        pass


class ExtraState(Good):
    def model(self, ctx):
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), _Tagged(16, 1), nn.Flatten(0))


class LateNumpy(NumpyState):
    """The running mean starts as None (a snapshot takes it) and becomes a numpy array at the first batch."""

    def __init__(self, rows: int = 256):
        super().__init__(rows)
        self.mean = None

    def loss(self, model, batch):
        self.mean = batch[0].mean(0).numpy()
        return super().loss(model, batch)
