"""The task of bench/export.py: a wide MLP on a few rows of random numbers, so that its model's weights
are nearly all of what an export holds in memory (the data is kilobytes, the model hundreds of MB).

    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 -m trainapp train \
        task.name=bench.export_task:WideMLP task.args.width=2048 task.args.depth=18 parallel.strategy=fsdp

`depth` square layers `width` wide (a ReLU between them): depth * (width**2 + width) parameters, e.g.
2048 x 18 = 75.5 M, 302 MB in fp32. Each layer is its own FSDP unit (the model's children).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class WideMLP:
    random_items = False  # fixed tensors: no per-item seeding

    def __init__(self, width: int = 2048, depth: int = 18, rows: int = 64):
        if width < 1 or depth < 1 or rows < 2:
            raise ValueError(f"width={width}, depth={depth}, rows={rows}: "
                             f"need width >= 1, depth >= 1, rows >= 2")
        self.width, self.depth, self.rows = width, depth, rows

    def datasets(self, ctx):
        g = torch.Generator().manual_seed(ctx.seed)
        x = torch.randn(self.rows, self.width, generator=g)
        y = torch.randn(self.rows, self.width, generator=g)
        half = self.rows // 2
        return list(zip(x[:half], y[:half])), list(zip(x[half:], y[half:]))

    def model(self, ctx):
        layers: list[nn.Module] = []
        for i in range(self.depth):
            layers += [nn.Linear(self.width, self.width)] + ([nn.ReLU()] if i < self.depth - 1 else [])
        return nn.Sequential(*layers)

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    def evaluate(self, model, batch):
        x, y = batch
        return {"mse": ((model(x).float() - y) ** 2).mean(1).sum(), "count": len(y)}
