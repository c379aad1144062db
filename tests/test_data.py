import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from trainapp.config import ConfigError, DataSection, TrainSection
from trainapp.core.data import ResumableDistributedSampler, SeededItems, set_epoch
from trainapp.core.layout import Layout
from trainapp.tasks.image import SyntheticImages, build_datasets

CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def write_tiny_cifar10(root: Path, per_batch: int = 6) -> np.ndarray:
    """CIFAR-10 in torchvision's on-disk format (python pickles), with a few images per batch."""
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    rng = np.random.default_rng(0)
    first = None
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        first = data if first is None else first
        labels = [int(x) for x in rng.integers(0, 10, size=per_batch)]
        with open(base / name, "wb") as f:
            pickle.dump({"batch_label": name, "labels": labels, "data": data,
                         "filenames": [f"{i}.png" for i in range(per_batch)]}, f)
    with open(base / "batches.meta", "wb") as f:
        pickle.dump({"label_names": CIFAR_CLASSES, "num_cases_per_batch": per_batch}, f)
    return first


def write_tiny_imagefolder(root: Path, classes=("cat", "dog", "fox"), per_class: int = 4,
                           size=(20, 14)) -> None:
    from PIL import Image

    rng = np.random.default_rng(1)
    for split in ("train", "val"):
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(pixels).save(d / f"{i}.{'png' if i % 2 else 'jpg'}")


# --- synthetic ------------------------------------------------------------------------------------

def test_synthetic_set_is_a_pure_function_of_the_seed():
    a = SyntheticImages(64, 10, 16, seed=3, split="train")
    b = SyntheticImages(64, 10, 16, seed=3, split="train")
    c = SyntheticImages(64, 10, 16, seed=4, split="train")
    assert torch.equal(a.images, b.images) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.images, c.images)
    val = SyntheticImages(64, 10, 16, seed=3, split="val")
    assert not torch.equal(a.images, val.images)


def test_synthetic_classes_are_separable_by_their_prototypes():
    # Learnable: the class mean images differ far more than chance would make them.
    ds = SyntheticImages(2000, 4, 16, seed=0, split="train")
    means = torch.stack([ds.images[ds.targets == k].mean(0) for k in range(4)])
    nearest = ((ds.images[:, None] - means[None]) ** 2).flatten(2).sum(-1).argmin(1)
    assert (nearest == ds.targets).float().mean() > 0.6


# --- sampler --------------------------------------------------------------------------------------

def _layout(world, rank, batch, global_batch=None, samples=10_000):
    return Layout(TrainSection(batch_size=batch, global_batch=global_batch or batch * world), world, rank,
                  samples)


def _epoch_indices(n, world, batch, epoch=0, start=0, seed=0, global_batch=None):
    ds = list(range(n))
    per_rank = []
    for r in range(world):
        s = ResumableDistributedSampler(ds, world, r, shuffle=True, seed=seed,
                                        layout=_layout(world, r, batch, global_batch, n))
        s.set_epoch(epoch, start)
        per_rank.append(list(s))
        assert len(s) == len(per_rank[-1])
    return per_rank


@pytest.mark.parametrize("world", [1, 2, 3])
def test_after_k_batches_the_consumed_set_is_a_prefix_of_the_permutation(world):
    n, batch, k = 100, 4, 5
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    per_rank = _epoch_indices(n, world, batch)
    consumed = set()
    for r in range(world):
        consumed |= set(per_rank[r][: k * batch])
    assert consumed == set(perm[: k * batch * world])


@pytest.mark.parametrize("world_before, world_after", [(2, 2), (2, 1), (1, 3), (3, 2)])
def test_resume_at_a_sample_offset_neither_repeats_nor_skips(world_before, world_after):
    n, batch, steps_before = 120, 4, 3
    before = _epoch_indices(n, world_before, batch)
    done = [i for r in range(world_before) for i in before[r][: steps_before * batch]]
    offset = steps_before * batch * world_before
    after = [i for r in _epoch_indices(n, world_after, batch, start=offset) for i in r]
    assert not set(done) & set(after)
    assert len(set(done)) == len(done) and len(set(after)) == len(after)
    gb_after = batch * world_after
    # only the epoch's tail (less than one global batch) is left out
    assert n - len(done) - len(after) < gb_after


def test_same_world_size_resume_yields_exactly_the_uninterrupted_order():
    full = _epoch_indices(96, 2, 4, epoch=5)
    resumed = _epoch_indices(96, 2, 4, epoch=5, start=2 * 4 * 2)
    for r in range(2):
        assert resumed[r] == full[r][2 * 4:]


def _micro_batches(per_rank, world, batch, global_batch):
    """{(step, slot): the samples of that micro-batch}, from each rank's sampler output."""
    out = {}
    for r, indices in enumerate(per_rank):
        chunks = [tuple(indices[i:i + batch]) for i in range(0, len(indices), batch)]
        mine = len(range(r, global_batch // batch, world))
        for c, chunk in enumerate(chunks):
            out[(c // mine, (c % mine) * world + r)] = chunk
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_a_global_batch_is_cut_into_the_same_micro_batches_at_every_world_size(world):
    n, batch, global_batch = 150, 4, 24  # 6 slots: even over 1, 2, 3 and 6 ranks, uneven over 4
    straight = _micro_batches(_epoch_indices(n, 1, batch, global_batch=global_batch), 1, batch, global_batch)
    resized = _micro_batches(_epoch_indices(n, world, batch, global_batch=global_batch), world, batch,
                             global_batch)
    assert resized == straight and len(straight) == (n // global_batch) * 6


def test_uneven_slots_give_the_first_ranks_one_micro_batch_more_and_lose_none():
    layout = [_layout(4, r, 4, 24) for r in range(4)]
    assert [x.micro_steps() for x in layout] == [2, 2, 1, 1] and not layout[0].even
    assert [x.slot(m) for x in layout for m in range(x.micro_steps())] == [0, 4, 1, 5, 2, 3]
    assert layout[0].loss_weight == 4 / 6
    per_rank = _epoch_indices(96, 4, 4, global_batch=24)
    assert sorted(i for r in per_rank for i in r) == sorted(set(i for r in per_rank for i in r))
    assert [len(r) for r in per_rank] == [4 * 2 * 4, 4 * 2 * 4, 4 * 4, 4 * 4]


def test_a_resumed_layout_keeps_the_snapshots_global_batch_or_rescales_as_told():
    keep = Layout(TrainSection(batch_size=8, grad_accum=1), 1, 0, 1000)  # started on 2: 16 samples a step
    keep.resume(16, 2)
    assert ((keep.global_batch, keep.micro_steps(), keep.resized_from)
            == (16, 2, {"world_size": 2, "global_batch": 16}))
    assert "world size 2 -> 1: global batch kept: 2 micro-batch(es) of 8 per rank" == keep.line()
    rescale = Layout(TrainSection(batch_size=8, on_resize="rescale"), 1, 0, 1000)
    rescale.resume(16, 2)
    assert rescale.global_batch == 8 and "rescaled" in rescale.line()
    told = Layout(TrainSection(batch_size=8, global_batch=32), 2, 0, 1000)
    told.resume(16, 2)
    assert told.global_batch == 32 and told.line() is None  # the config's explicit size wins


@pytest.mark.parametrize("train, world, key", [
    (dict(batch_size=8, global_batch=12), 1, "train.global_batch=12"),  # not whole micro-batches
    (dict(batch_size=8, global_batch=16), 3, "train.global_batch=16"),  # 2 slots, 3 ranks
    (dict(batch_size=64), 1, "train.batch_size=64"),                    # more than the data
])
def test_a_layout_that_cannot_train_names_the_key(train, world, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Layout(TrainSection(**train), world, 0, 50)


def test_every_rank_gets_whole_global_batches_only():
    per_rank = _epoch_indices(101, 2, 4)
    assert all(len(x) == 12 * 4 for x in per_rank)  # 101 // 8 = 12 global batches


def test_eval_sampler_visits_every_sample_once_without_padding():
    ds = list(range(11))
    seen = []
    for r in range(3):
        seen += list(ResumableDistributedSampler(ds, 3, r, shuffle=False, seed=0))
    assert sorted(seen) == ds


def test_epochs_are_shuffled_differently():
    assert _epoch_indices(50, 1, 5, epoch=0) != _epoch_indices(50, 1, 5, epoch=1)


# --- real on-disk datasets ------------------------------------------------------------------------

def test_cifar10_reads_torchvisions_files(tmp_path):
    first = write_tiny_cifar10(tmp_path)
    cfg = DataSection(name="cifar10", root=str(tmp_path), augment=False)
    train, val, classes = build_datasets(cfg, seed=0)
    assert classes == 10 and len(train) == 30 and len(val) == 6
    x, y = train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= y < 10
    # Undo the normalisation: the first pixel of the first image is what we wrote.
    mean, std = torch.tensor([0.4914, 0.4822, 0.4465]), torch.tensor([0.2470, 0.2435, 0.2616])
    pixel = (x[:, 0, 0] * std + mean) * 255
    expected = torch.tensor([first[0, 0], first[0, 1024], first[0, 2048]], dtype=torch.float32)
    assert torch.allclose(pixel, expected, atol=0.01)


def test_cifar10_missing_names_the_path_and_never_downloads(tmp_path):
    cfg = DataSection(name="cifar10", root=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=r"data\.root=.*absent: no CIFAR-10 there .*data\.download=true"):
        build_datasets(cfg, seed=0)
    assert not (tmp_path / "absent").exists()


def test_cifar10_resizes_to_image_size(tmp_path):
    write_tiny_cifar10(tmp_path)
    train, _, _ = build_datasets(DataSection(name="cifar10", root=str(tmp_path), image_size=24), seed=0)
    assert train[1][0].shape == (3, 24, 24)


def test_imagefolder_reads_train_and_val_resized(tmp_path):
    write_tiny_imagefolder(tmp_path)
    cfg = DataSection(name="imagefolder", root=str(tmp_path), image_size=16)
    train, val, classes = build_datasets(cfg, seed=0)
    assert classes == 3 and len(train) == 12 and len(val) == 12
    assert train[0][0].shape == (3, 16, 16) and val[5][0].shape == (3, 16, 16)
    assert {train[i][1] for i in range(12)} == {0, 1, 2}


def test_imagefolder_with_different_classes_in_val_is_rejected(tmp_path):
    write_tiny_imagefolder(tmp_path)
    (tmp_path / "val" / "fox").rename(tmp_path / "val" / "wolf")
    with pytest.raises(ConfigError, match="different class folders"):
        build_datasets(DataSection(name="imagefolder", root=str(tmp_path)), seed=0)


def test_augmentation_depends_only_on_seed_epoch_and_index(tmp_path):
    write_tiny_imagefolder(tmp_path, size=(32, 32))
    raw, _, _ = build_datasets(DataSection(name="imagefolder", root=str(tmp_path), image_size=32), seed=0)
    train = SeededItems(raw, seed=0)
    sampler = ResumableDistributedSampler(train, 1, 0, shuffle=True, seed=0, layout=_layout(1, 0, 4))
    set_epoch(train, sampler, 3)
    a = train[2][0]
    torch.manual_seed(12345)  # the global RNG must not matter
    b = train[2][0]
    set_epoch(train, sampler, 4)
    c = train[2][0]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# --- the same files through the whole training loop -----------------------------------------------

def _train_on(tmp_path, *overrides):
    from trainapp import config
    from trainapp.launch.rank import run_rank
    from trainapp.launch.torchrun import Torchrun

    cfg = config.load(None, [f"run.dir={tmp_path / 'run'}", "train.progress=false", "train.max_steps=3",
                             "train.batch_size=4", "snapshot.every_steps=2", *overrides])
    return run_rank(Torchrun(), cfg)


def test_a_short_run_trains_on_imagefolder_with_loader_workers(tmp_path):
    write_tiny_imagefolder(tmp_path / "data", size=(40, 30))
    summary = _train_on(tmp_path, "data.name=imagefolder", f"data.root={tmp_path / 'data'}",
                        "data.image_size=24", "data.num_workers=1", "model.num_classes=3")
    assert summary["steps"] == 3 and 0.0 <= summary["val_acc"] <= 1.0


def test_a_short_run_trains_on_cifar10_files(tmp_path):
    write_tiny_cifar10(tmp_path / "data")
    summary = _train_on(tmp_path, "data.name=cifar10", f"data.root={tmp_path / 'data'}",
                        "model.name=resnet18")
    assert summary["steps"] == 3
