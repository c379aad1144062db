"""Datasets, the resumable distributed sampler, and where training is in them (`Progress`).

Exact resume depends on the data order being a pure function of (seed, epoch, position): the sampler
draws one permutation per epoch and can start at any global sample offset, and random augmentations
are seeded per (seed, epoch, sample), so a run restarted mid-epoch sees what the uninterrupted run saw.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainapp.config import ConfigError, DataSection, TrainSection

log = logging.getLogger(__name__)

# Per-channel statistics used to normalise real images (CIFAR-10's; close enough for small photos).
_MEAN, _STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class SyntheticImages(Dataset):
    """A deterministic, learnable class-conditional image set made from a seed (no files).

    Each class has a smooth random prototype image; a sample is its class prototype plus per-sample
    noise strong enough that a small CNN needs a few hundred steps to separate the classes.
    """

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int, split: str, noise: float = 6.0):
        protos_gen = torch.Generator().manual_seed(seed)
        coarse = torch.randn(num_classes, 3, 4, 4, generator=protos_gen)
        protos = torch.nn.functional.interpolate(coarse, size=(image_size, image_size), mode="bilinear",
                                                 align_corners=False)
        # Train and val share the prototypes but not the samples.
        gen = torch.Generator().manual_seed(seed * 1_000_003 + (1 if split == "train" else 2))
        self.targets = torch.randint(num_classes, (size,), generator=gen)
        self.images = protos[self.targets] + noise * torch.randn(size, 3, image_size, image_size, generator=gen)
        self.classes = [f"class{i}" for i in range(num_classes)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.images[i], self.targets[i]


def _sample_seed(seed: int, epoch: int, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SeededTransform(Dataset):
    """Applies `transform` with the torch RNG seeded from (seed, epoch, index), then restores the RNG.

    Random augmentations then depend only on which sample is read in which epoch, not on which
    DataLoader worker reads it or how far the process had got: a mid-epoch restart is exact.
    """

    def __init__(self, base: Dataset, transform: Callable, seed: int):
        self.base, self.transform, self.seed, self.epoch = base, transform, seed, 0
        self.classes = getattr(base, "classes", None)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        img, target = self.base[i]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_sample_seed(self.seed, self.epoch, i))
            return self.transform(img), target


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start an epoch at a global sample offset.

    The epoch's permutation is DistributedSampler's (seeded by seed + epoch). Rank r takes every
    world_size-th index of the permutation from `start` on, so after k batches on every rank exactly
    the first start + k*batch*world_size indices of the permutation are consumed, whatever the world
    size: a run resumed at another world size continues at the same global sample position.

    With `global_batch`, each rank gets only whole global batches (the epoch's tail is dropped, as
    with drop_last); without it (evaluation) every index is visited exactly once, unpadded.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool, seed: int,
                 global_batch: int | None = None):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.global_batch, self.start = global_batch, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def steps_from(self, start: int) -> int:
        """Whole global batches (optimizer steps) in an epoch from global sample `start` on: the one
        place that says an epoch ends when less than a global batch is left."""
        if not self.global_batch:
            raise ValueError("steps_from() is for training samplers (made with global_batch)")
        return max(0, len(self.dataset) - start) // self.global_batch

    def steps_left(self) -> int:
        """Whole global batches left in this epoch from `start`."""
        return self.steps_from(self.start)

    def _order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self):
        order = self._order()
        end = self.start + self.steps_left() * self.global_batch if self.global_batch else len(order)
        return iter(order[self.start:end][self.rank::self.num_replicas])

    def __len__(self) -> int:
        if self.global_batch:
            return self.steps_left() * self.global_batch // self.num_replicas
        return len(range(self.rank, len(self.dataset), self.num_replicas))


# ----------------------------------------------------------------------------------------------
# Real datasets


def _transforms(image_size: int, train: bool, augment: bool, resize: bool):
    from torchvision.transforms import v2

    steps = [v2.ToImage()]
    if resize:
        steps += [v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)]
    if train and augment:
        steps += [v2.RandomCrop(image_size, padding=max(1, image_size // 8)), v2.RandomHorizontalFlip()]
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(_MEAN, _STD)]
    return v2.Compose(steps)


def _cifar10_class():
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


def _cifar10(cfg: DataSection, is_main: bool, wait: Callable[[], None]):
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


def _imagefolder(cfg: DataSection):
    from torchvision.datasets import ImageFolder

    root = Path(cfg.root)
    parts = {}
    for split in ("train", "val"):
        d = root / split
        if not d.is_dir():
            raise ConfigError(f"data.root={root}: missing {d}/ (imagefolder expects {root}/train/<class>/*.jpg "
                              f"and {root}/val/<class>/*.jpg)")
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
        train = SyntheticImages(cfg.train_size, cfg.synthetic_classes, cfg.image_size, seed, "train")
        val = SyntheticImages(cfg.val_size, cfg.synthetic_classes, cfg.image_size, seed, "val")
        return train, val, cfg.synthetic_classes
    if cfg.name == "cifar10":
        train, val, resize = _cifar10(cfg, is_main, wait)
    else:
        train, val, resize = _imagefolder(cfg)
    num_classes = len(train.classes)
    train = SeededTransform(train, _transforms(cfg.image_size, True, cfg.augment, resize), seed)
    val = SeededTransform(val, _transforms(cfg.image_size, False, False, resize), seed)
    return train, val, num_classes


def make_loader(dataset: Dataset, sampler: ResumableDistributedSampler, batch_size: int, num_workers: int,
                pin_memory: bool, generator_seed: int) -> DataLoader:
    # An explicit generator keeps DataLoader's worker base seed off the global torch RNG, whose
    # position differs between an uninterrupted run and one resumed mid-epoch.
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
        drop_last=False, generator=torch.Generator().manual_seed(generator_seed),
        persistent_workers=False,
    )


def set_epoch(dataset: Dataset, sampler: ResumableDistributedSampler, epoch: int, start: int = 0) -> None:
    sampler.set_epoch(epoch, start)
    if isinstance(dataset, SeededTransform):
        dataset.set_epoch(epoch)


class EpochBatches:
    """The training batches of an epoch from a global sample on: the sampler (and the augmentations) set
    to that position, and a fresh loader over it."""

    def __init__(self, dataset: Dataset, sampler: ResumableDistributedSampler, batch_size: int, num_workers: int,
                 pin_memory: bool, seed: int):
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.num_workers, self.pin_memory, self.seed = num_workers, pin_memory, seed

    def steps_from(self, start: int) -> int:
        return self.sampler.steps_from(start)

    def epoch(self, epoch: int, start: int) -> Iterator:
        set_epoch(self.dataset, self.sampler, epoch, start)
        return iter(make_loader(self.dataset, self.sampler, self.batch_size, self.num_workers, self.pin_memory,
                                self.seed * 100_003 + epoch))


class Progress:
    """Where training is: optimizer steps done, the epoch and the global sample position in it, and
    the fp16 steps the GradScaler skipped (a device counter, so counting costs no host sync)."""

    def __init__(self, world_size: int, global_batch: int, device: torch.device):
        self.global_step, self.epoch, self.epoch_sample = 0, 0, 0
        self.world_size, self.global_batch = world_size, global_batch
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.resumed: dict[str, Any] | None = None
        """The progress of the snapshot this run resumed from (its world size and global batch too)."""

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "epoch": self.epoch, "epoch_sample": self.epoch_sample,
                "world_size": self.world_size, "global_batch": self.global_batch,
                "skipped_steps": int(self.skipped.item())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step, self.epoch, self.epoch_sample = state["global_step"], state["epoch"], state["epoch_sample"]
        self.skipped.fill_(state.get("skipped_steps", 0))
        self.resumed = dict(state)

    def advance(self, steps_from: Callable[[int], int]) -> bool:
        """Count the step just taken; True when it was the epoch's last (`steps_from`: the sampler's)."""
        self.global_step += 1
        self.epoch_sample += self.global_batch
        if steps_from(self.epoch_sample) == 0:
            self.epoch, self.epoch_sample = self.epoch + 1, 0
            return True
        return False


def plan_total(sampler: ResumableDistributedSampler, progress: Progress, train: TrainSection) -> int:
    """Steps done plus steps left: the rest of this epoch and the full epochs after it."""
    left = 0
    if progress.epoch < train.epochs:
        left = sampler.steps_from(progress.epoch_sample) + (train.epochs - progress.epoch - 1) * sampler.steps_from(0)
    total = progress.global_step + left
    return min(total, train.max_steps) if train.max_steps is not None else total
