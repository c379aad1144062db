"""Regression on tabular data: a template of a task of your own for trainapp (docs/your-own-model.md).

Copy this folder, replace the data, model and loss with yours, and run it:

    PYTHONPATH=examples/tabular torchrun --standalone --nproc_per_node=2 -m trainapp train \
        --config examples/tabular/config.yaml task.name=tabular_task:Regression task.args.hidden=64

The data here is made from the run's seed (so the example needs no files): rows of `features`
numbers whose target is a fixed nonlinear function of them plus noise. Items are dicts, the way
tabular and text pipelines usually hand them over; trainapp batches them and moves every tensor to
the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Rows(Dataset):
    """`n` rows of `features` columns, and their targets; `jitter` adds fresh noise to the features
    each time a row is read (a random augmentation: trainapp seeds it per epoch and row, so a resumed
    run draws what the uninterrupted one drew)."""

    def __init__(self, n: int, features: int, seed: int, split: str, jitter: float):
        weights = torch.Generator().manual_seed(seed)  # the function to learn: the same for both splits
        self.w1 = torch.randn(features, 32, generator=weights) / features ** 0.5
        self.w2 = torch.randn(32, generator=weights) / 32 ** 0.5
        rows = torch.Generator().manual_seed(seed * 7919 + (1 if split == "train" else 2))
        self.x = torch.randn(n, features, generator=rows)
        self.y = torch.sin(self.x @ self.w1) @ self.w2 * 3 + 0.1 * torch.randn(n, generator=rows)
        self.jitter = jitter

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.x[i]
        if self.jitter:
            x = x + self.jitter * torch.randn_like(x)
        return {"features": x, "target": self.y[i], "index": torch.tensor(i)}


class MLP(nn.Module):
    def __init__(self, features: int, hidden: int, depth: int, dropout: float):
        super().__init__()
        layers, width = [], features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)


class Regression:
    """The task: its arguments are `task.args` (`task.args.hidden=64` on the command line)."""

    def __init__(self, features: int = 16, hidden: int = 128, depth: int = 3, dropout: float = 0.1,
                 train_rows: int = 8192, val_rows: int = 2048, jitter: float = 0.05):
        if features < 1 or hidden < 1 or depth < 1:
            raise ValueError(f"features={features}, hidden={hidden} and depth={depth} must be >= 1")
        self.features, self.hidden, self.depth, self.dropout = features, hidden, depth, dropout
        self.rows, self.jitter = (train_rows, val_rows), jitter

    # --- required: data, model, loss, evaluation ---------------------------------------------------

    def datasets(self, ctx):
        """(train, val). `ctx.seed` makes the data; `ctx.rank`, `ctx.world_size`, `ctx.device` and
        `ctx.run_dir` are there too (rank 0 could download into run_dir while the others wait at
        `ctx.barrier()`)."""
        return (Rows(self.rows[0], self.features, ctx.seed, "train", self.jitter),
                Rows(self.rows[1], self.features, ctx.seed, "val", 0.0))

    def model(self, ctx) -> nn.Module:
        return MLP(self.features, self.hidden, self.depth, self.dropout)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(model(batch["features"]).float(), batch["target"])

    def evaluate(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        err = model(batch["features"]).float() - batch["target"]
        return {"mse": (err ** 2).sum(), "mae": err.abs().sum(), "count": err.numel()}

    # --- optional ---------------------------------------------------------------------------------

    def param_groups(self, model: MLP) -> list[dict]:
        """No weight decay on biases and LayerNorm; the head learns at twice the rate."""
        body = [p for p in model.body.parameters() if p.ndim > 1]
        flat = [p for p in model.body.parameters() if p.ndim <= 1]
        return [{"params": body}, {"params": flat, "weight_decay": 0.0},
                {"params": model.head.parameters(), "lr_mult": 2.0}]
