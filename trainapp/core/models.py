"""Models: a small built-in CNN for fast CPU runs, and torchvision classifiers by name."""

from __future__ import annotations

import logging

import torch
from torch import nn

from trainapp.config import ConfigError, ModelSection

log = logging.getLogger(__name__)


class SmallCNN(nn.Module):
    """Three conv-BN-ReLU blocks and a linear head: trains to high accuracy on the synthetic set in
    under a minute on two CPU cores, and has BatchNorm so SyncBatchNorm and buffers are exercised."""

    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU(inplace=True), nn.MaxPool2d(2))

        self.features = nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


def torchvision_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def build_model(name: str, num_classes: int) -> nn.Module:
    if name == "smallcnn":
        return SmallCNN(num_classes)
    import torchvision

    names = torchvision_names()
    if name not in names:
        examples = ", ".join(n for n in ("resnet18", "resnet50", "mobilenet_v3_small") if n in names)
        raise ConfigError(f"model.name={name!r}: unknown model; use smallcnn or a torchvision classification "
                          f"model such as {examples}")
    # weights=None: no download at run time; training starts from random weights.
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def make_model(cfg: ModelSection, num_classes: int, seed: int, ctx) -> nn.Module:
    """The run's model on this rank's device, initialised from `seed`, identically on every rank (DDP
    would broadcast rank 0's anyway)."""
    torch.manual_seed(seed)
    model = build_model(cfg.name, num_classes).to(ctx.device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.sync_bn and ctx.distributed:
        if ctx.device.type == "cuda":
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        elif ctx.is_main:
            log.warning("model.sync_bn=true ignored: SyncBatchNorm needs CUDA; plain BatchNorm on CPU")
    return model
