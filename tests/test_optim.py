import math

import pytest
import torch

from trainapp.config import ConfigError, OptimSection, SchedSection
from trainapp.core.optim import (
    WarmupCosine,
    build_ema,
    build_optimizer,
    build_scheduler,
    param_groups,
    rescale,
    scaled_lr,
)
from trainapp.tasks.image import SmallCNN, build_model


@pytest.mark.parametrize("mode, expected", [("none", 0.1), ("linear", 0.4), ("sqrt", 0.2)])
def test_lr_is_scaled_by_global_batch(mode, expected):
    cfg = OptimSection(lr=0.1, base_batch_size=64, lr_scaling=mode)
    assert scaled_lr(cfg, 256) == pytest.approx(expected)


def test_no_weight_decay_on_biases_and_norm_weights():
    model = SmallCNN(10)
    groups = param_groups(model, OptimSection(weight_decay=0.01))
    by_id = {id(p): g for g in groups for p in g["params"]}
    norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters()}
    for name, p in model.named_parameters():
        expected = 0.0 if (name.endswith("bias") or id(p) in norms) else 0.01
        assert by_id[id(p)]["weight_decay"] == expected, name
    assert any(g["weight_decay"] == 0.01 for g in groups)


def test_per_module_lr_multipliers_pick_the_longest_prefix():
    model = SmallCNN(10)
    opt = build_optimizer(model, OptimSection(lr=0.1, base_batch_size=128,
                                              lr_mult={"fc": 10.0, "features.0": 0.5, "features.0.0": 0.25}),
                          128)
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert lr_of[id(model.fc.weight)] == pytest.approx(1.0)
    assert lr_of[id(model.features[0][0].weight)] == pytest.approx(0.025)  # features.0.0 beats features.0
    assert lr_of[id(model.features[0][1].weight)] == pytest.approx(0.05)
    assert lr_of[id(model.features[1][0].weight)] == pytest.approx(0.1)


def test_lr_mult_key_matching_nothing_is_an_error():
    with pytest.raises(ConfigError, match="optim.lr_mult key 'head'"):
        param_groups(SmallCNN(10), OptimSection(lr_mult={"head": 2.0}))


def test_warmup_then_cosine_to_the_floor():
    f = WarmupCosine(warmup=4, total=24, min_ratio=0.1)
    assert f(0) == pytest.approx(0.2) and f(3) == pytest.approx(0.8)
    assert f(4) == pytest.approx(1.0)
    assert f(14) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(24) == pytest.approx(0.1) and f(30) == pytest.approx(0.1)
    values = [f(s) for s in range(4, 25)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_rescale_after_a_world_size_change_keeps_the_schedule_position():
    model = SmallCNN(10)
    cfg = OptimSection(lr=0.1, base_batch_size=128, lr_scaling="linear", lr_mult={"fc": 2.0})
    opt = build_optimizer(model, cfg, 256)
    sched = build_scheduler(opt, SchedSection(warmup_steps=0), 100)
    for _ in range(30):
        opt.step()
        sched.step()
    lr_256 = [g["lr"] for g in opt.param_groups]
    rescale(opt, sched, cfg, 128)  # half the workers: half the global batch
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([x / 2 for x in lr_256])
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * opt.param_groups[0]["lr_mult"] * 0.5 *
                                                      (1 + math.cos(math.pi * 31 / 100)))


def test_ema_tracks_the_weights_slowly():
    model = torch.nn.Linear(2, 1)
    ema = build_ema(model, 0.9)
    ema.update_parameters(model)  # the first update copies
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update_parameters(model)
    delta = ema.module.weight - (model.weight - 1.0)
    assert torch.allclose(delta, torch.full_like(delta, 0.1))
    assert build_ema(model, 0.0) is None


def test_torchvision_models_are_built_by_name_without_downloads():
    m = build_model("resnet18", 7)
    assert m.fc.out_features == 7
    with pytest.raises(ConfigError, match=r"model.name='resnet9000'"):
        build_model("resnet9000", 7)
