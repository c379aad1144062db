"""The built-in image classification task (`task.name=image_classification`, the default): a small
CNN or a torchvision classifier on synthetic images, CIFAR-10 or an ImageFolder tree, configured by
the `data.*` and `model.*` keys. It is a task like any user's (trainapp/tasks/api.py): the loop knows
nothing of images, classes, channels_last or cross-entropy.

Random augmentations draw from torch's generator, which trainapp seeds per (seed, epoch, sample)
around every item (trainapp/core/data.py's `SeededItems`), so a restarted run sees what the
uninterrupted one saw.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainapp.config import Config, ConfigError, DataSection, ModelSection

if TYPE_CHECKING:
    from trainapp.tasks.api import TaskContext

log = logging.getLogger(__name__)

# Per-channel statistics used to normalise real images (CIFAR-10's; close enough for small photos).
_MEAN, _STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class SyntheticImages(Dataset):
    """A deterministic, learnable class-conditional image set made from a seed (no files).

    Each class has a smooth random prototype image; a sample is its class prototype plus per-sample
    noise strong enough that a small CNN needs a few hundred steps to separate the classes.
    """

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int, split: str,
                 noise: float = 6.0):
        protos_gen = torch.Generator().manual_seed(seed)
        coarse = torch.randn(num_classes, 3, 4, 4, generator=protos_gen)
        protos = torch.nn.functional.interpolate(coarse, size=(image_size, image_size), mode="bilinear",
                                                 align_corners=False)
        # Train and val share the prototypes but not the samples.
        gen = torch.Generator().manual_seed(seed * 1_000_003 + (1 if split == "train" else 2))
        self.targets = torch.randint(num_classes, (size,), generator=gen)
        self.images = protos[self.targets] + noise * torch.randn(size, 3, image_size, image_size,
                                                                 generator=gen)
        self.classes = [f"class{i}" for i in range(num_classes)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.targets[i]


class _Labelled(Protocol):
    """A torchvision dataset of (image, target) items: CIFAR10's or ImageFolder's."""

    classes: list[str]

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> tuple[Any, int]: ...


class _Transformed(Dataset):
    """`base`'s (image, target) items with `transform` applied to the image."""

    def __init__(self, base: _Labelled, transform: Callable[[Any], torch.Tensor]):
        self.base, self.transform = base, transform
        self.classes = base.classes

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img, target = self.base[i]
        return self.transform(img), target


def _transforms(image_size: int, train: bool, augment: bool, resize: bool) -> Callable[[Any], torch.Tensor]:
    from torchvision.transforms import v2

    steps = [v2.ToImage()]
    if resize:
        steps += [v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)]
    if train and augment:
        steps += [v2.RandomCrop(image_size, padding=max(1, image_size // 8)), v2.RandomHorizontalFlip()]
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(_MEAN, _STD)]
    return v2.Compose(steps)


def _cifar10_class() -> Callable[..., _Labelled]:
    from torchvision.datasets import CIFAR10

    class CIFAR10Files(CIFAR10):
        """torchvision's CIFAR10 reader without the per-file md5 check (md5=None: present counts).

        That check re-hashes all 170 MB on every rank at every start, and rejects the small files our
        tests write in the same format. A corrupt batch file still fails to unpickle.
        """

        train_list = [[name, None] for name, _ in CIFAR10.train_list]
        test_list = [[name, None] for name, _ in CIFAR10.test_list]
        meta = {**CIFAR10.meta, "md5": None}

    return CIFAR10Files


def _cifar10(cfg: DataSection, is_main: bool, wait: Callable[[], None]) -> tuple[_Labelled, _Labelled, bool]:
    root = Path(cfg.root)
    cls = _cifar10_class()
    if cfg.download:
        # Rank 0 downloads while the others wait, so they never read a half-written archive.
        if is_main:
            try:
                cls(str(root), train=True, download=True)
            except Exception as e:  # network or disk failure: the user must act
                raise ConfigError(f"data.root={root}: CIFAR-10 download failed ({e}); "
                                  "place the files there and set data.download=false") from None
        wait()
    try:
        train = cls(str(root), train=True)
        val = cls(str(root), train=False)
    except RuntimeError:
        raise ConfigError(
            f"data.root={root}: no CIFAR-10 there (expected {root}/cifar-10-batches-py/data_batch_1..5 and "
            "test_batch); put the dataset there or set data.download=true"
        ) from None
    except Exception as e:  # a truncated or foreign pickle
        raise ConfigError(f"data.root={root}: CIFAR-10 files are unreadable ({e.__class__.__name__}: {e}); "
                          "re-download them") from None
    return train, val, cfg.image_size != 32


def _imagefolder(cfg: DataSection) -> tuple[_Labelled, _Labelled, bool]:
    from torchvision.datasets import ImageFolder

    root = Path(cfg.root)
    parts: dict[str, _Labelled] = {}
    for split in ("train", "val"):
        d = root / split
        if not d.is_dir():
            raise ConfigError(f"data.root={root}: missing {d}/ (imagefolder expects "
                              f"{root}/train/<class>/*.jpg and {root}/val/<class>/*.jpg)")
        try:
            parts[split] = ImageFolder(str(d))
        except (FileNotFoundError, OSError) as e:
            raise ConfigError(f"data.root={root}: {d} has no usable class folders ({e})") from None
    if parts["train"].classes != parts["val"].classes:
        raise ConfigError(f"data.root={root}: train/ and val/ have different class folders "
                          f"({parts['train'].classes} vs {parts['val'].classes})")
    return parts["train"], parts["val"], True


def build_datasets(cfg: DataSection, seed: int, is_main: bool = True,
                   wait: Callable[[], None] = lambda: None) -> tuple[Dataset, Dataset, int]:
    """(train, val, num_classes) for `data.name`; bad paths raise ConfigError naming them."""
    if cfg.name == "synthetic":
        train_set = SyntheticImages(cfg.train_size, cfg.synthetic_classes, cfg.image_size, seed, "train")
        val_set = SyntheticImages(cfg.val_size, cfg.synthetic_classes, cfg.image_size, seed, "val")
        return train_set, val_set, cfg.synthetic_classes
    if cfg.name == "cifar10":
        train, val, resize = _cifar10(cfg, is_main, wait)
    else:
        train, val, resize = _imagefolder(cfg)
    num_classes = len(train.classes)
    return (_Transformed(train, _transforms(cfg.image_size, True, cfg.augment, resize)),
            _Transformed(val, _transforms(cfg.image_size, False, False, resize)), num_classes)

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


class ImageClassification:
    """Classification of the `data.*` images by the `model.*` model: cross-entropy loss; accuracy
    and loss in evaluation (`val_acc`, `val_loss`)."""

    def __init__(self, data: DataSection | None = None, model: ModelSection | None = None):
        self.data, self.arch = data or DataSection(), model or ModelSection()
        self.num_classes: int | None = None
        # The synthetic images are fixed tensors: nothing random in reading one, no per-item seeding.
        self.random_items = self.data.name != "synthetic"

    def datasets(self, ctx: TaskContext) -> tuple[Dataset, Dataset]:
        train, val, num_classes = build_datasets(self.data, ctx.seed, ctx.is_main, ctx.barrier)
        if self.arch.num_classes is not None and self.arch.num_classes != num_classes:
            raise ConfigError(f"model.num_classes={self.arch.num_classes}: the dataset has {num_classes} "
                              "classes; set it equal or leave it empty")
        self.num_classes = num_classes
        return train, val

    def model(self, ctx: TaskContext) -> nn.Module:
        assert self.num_classes is not None, "datasets(ctx), which counts the classes, is called first"
        model = build_model(self.arch.name, self.num_classes)
        if self.arch.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if self.arch.sync_bn and ctx.world_size > 1:
            if ctx.device.type == "cuda":
                model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            elif ctx.is_main:
                log.warning("model.sync_bn=true ignored: SyncBatchNorm needs CUDA; plain BatchNorm on CPU")
        return model

    def _images(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.arch.channels_last else x

    def loss(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(self._images(x)), y)

    def evaluate(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> dict[str, torch.Tensor | int]:
        x, y = batch
        out = model(self._images(x))
        return {"acc": (out.argmax(1) == y).sum(), "loss": F.cross_entropy(out.float(), y, reduction="sum"),
                "count": y.numel()}


def from_config(cfg: Config) -> ImageClassification:
    """`task.name=image_classification`: the task of the `data.*` and `model.*` sections (no `task.args`)."""
    return ImageClassification(cfg.data, cfg.model)
