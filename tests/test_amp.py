"""Mixed precision on CPU: bf16 autocast, fp16 autocast with GradScaler (loss scaling, skipped steps), off."""

import math

import pytest
import torch

from helpers import metrics
from trainapp import amp, config, dist, loop
from trainapp.amp import Precision, resolve_dtype
from trainapp.config import AmpSection

CPU = torch.device("cpu")


def _cfg(run_dir, *extra):
    # Small images: fp16 convolutions on CPU run on slow reference kernels.
    return config.load(None, [f"run.dir={run_dir}", "train.progress=false", "data.train_size=256",
                              "data.val_size=64", "data.image_size=16", "train.batch_size=32",
                              "train.log_every=2", *extra])


def _trainer(run_dir, *extra) -> loop.Trainer:
    return loop.trainer(_cfg(run_dir, *extra), dist.setup(60))


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, None)])
def test_auto_on_cpu_is_bf16_only_where_native_and_off_is_fp32(monkeypatch, native, expected):
    monkeypatch.setattr(amp, "cpu_has_native_bf16", lambda: native)
    assert resolve_dtype("auto", CPU) is expected
    assert resolve_dtype("bf16", CPU) is torch.bfloat16  # asked for explicitly: given, with a warning
    assert bool(amp.Precision(AmpSection(dtype="bf16"), CPU).note) is not native
    assert resolve_dtype("off", CPU) is None
    assert resolve_dtype("fp16", CPU) is torch.float16


@pytest.mark.parametrize("choice, dtype, scaling", [("bf16", torch.bfloat16, False), ("fp16", torch.float16, True),
                                                    ("off", torch.float32, False)])
def test_one_autocast_context_and_a_scaler_enabled_only_for_fp16(choice, dtype, scaling):
    p = Precision(AmpSection(dtype=choice), CPU)
    lin = torch.nn.Linear(8, 8)
    with p.autocast():
        out = lin(torch.randn(2, 8))
    assert out.dtype == dtype
    assert p.scaler.is_enabled() is scaling


def test_fp16_overflow_skips_the_step_counts_it_and_backs_off_the_scale(tmp_path):
    # A loss scale of 1e20 overflows fp16 gradients in the backward pass: the step must be skipped.
    t = _trainer(tmp_path, "amp.dtype=fp16", "amp.init_scale=1e20")
    before = {n: p.detach().clone() for n, p in t.parts.model.named_parameters()}
    loss = t._run_step(iter(torch.utils.data.DataLoader(t.parts.train_ds, batch_size=32)))
    assert math.isfinite(loss.item())  # the forward pass was fine
    assert int(t.parts.progress.skipped) == 1
    assert all(torch.equal(before[n], p) for n, p in t.parts.model.named_parameters())
    assert t.parts.precision.scaler.get_scale() == pytest.approx(0.5e20)


def test_fp16_with_a_sane_scale_updates_the_weights(tmp_path):
    t = _trainer(tmp_path, "amp.dtype=fp16")
    before = {n: p.detach().clone() for n, p in t.parts.model.named_parameters()}
    t._run_step(iter(torch.utils.data.DataLoader(t.parts.train_ds, batch_size=32)))
    assert int(t.parts.progress.skipped) == 0
    assert any(not torch.equal(before[n], p) for n, p in t.parts.model.named_parameters())


@pytest.mark.parametrize("choice", ["fp16", "bf16", "off"])
def test_a_short_run_trains_in_each_precision(tmp_path, choice):
    summary = loop.run(_cfg(tmp_path, f"amp.dtype={choice}", "train.max_steps=8", "amp.init_scale=1e12"))
    assert summary["steps"] == 8 and math.isfinite(summary["final_loss"])
    start = metrics(tmp_path, "start")[0]
    assert start["amp"] == {"fp16": "fp16", "bf16": "bf16", "off": "fp32"}[choice]
    train = metrics(tmp_path, "train")
    if choice == "fp16":
        # The oversized initial scale forces skipped steps; they are counted and logged, and the scale falls.
        assert train[-1]["skipped_steps"] >= 1 and train[-1]["loss_scale"] < 1e12
    else:
        assert "loss_scale" not in train[-1] and train[-1]["skipped_steps"] == 0


@pytest.mark.parametrize("bf16_ok, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_on_cuda_picks_bf16_where_supported_else_fp16(monkeypatch, bf16_ok, expected):
    # No GPU here: only the choice is checked, with CUDA's capability query stubbed.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_ok)
    assert resolve_dtype("auto", torch.device("cuda", 0)) is expected
