"""Mixed precision on CPU: bf16 autocast, fp16 autocast with GradScaler (loss scaling, skipped steps), off."""

import math

import pytest
import torch
from helpers import metrics

from trainapp import config
from trainapp.config import AmpSection
from trainapp.core import amp
from trainapp.core.amp import Precision, resolve_dtype
from trainapp.core.loop import Trainer
from trainapp.launch import rank
from trainapp.launch.torchrun import Torchrun

CPU = torch.device("cpu")


def _cfg(run_dir, *extra):
    # Small images: fp16 convolutions on CPU run on slow reference kernels.
    return config.load(None, [f"run.dir={run_dir}", "train.progress=false", "data.train_size=256",
                              "data.val_size=64", "data.image_size=16", "train.batch_size=32",
                              "train.log_every=2", *extra])


@pytest.fixture
def make_trainer(tmp_path):
    """Trainers in this process (steps called one by one), their launchers closed at the end: the
    worker registry must not keep the test process."""
    made = []

    def make(*extra) -> Trainer:
        cfg, launcher = _cfg(tmp_path, *extra), Torchrun()
        guard = launcher.guard(cfg.preempt)
        ctx = launcher.context(cfg.dist, cfg.network, guard)
        made.append((launcher, ctx))
        return rank.trainer(launcher, cfg, ctx, guard)

    yield make
    for launcher, ctx in made:
        launcher.close(ctx)


def _batches(t: Trainer):
    return iter(torch.utils.data.DataLoader(t.parts.batches.dataset, batch_size=32))


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, None)])
def test_auto_on_cpu_is_bf16_only_where_native_and_off_is_fp32(monkeypatch, native, expected):
    monkeypatch.setattr(amp, "cpu_has_native_bf16", lambda: native)
    assert resolve_dtype("auto", CPU)[0] is expected
    assert resolve_dtype("bf16", CPU)[0] is torch.bfloat16  # asked for explicitly: given, with a warning
    assert bool(amp.Precision(AmpSection(dtype="bf16"), CPU).note) is not native
    assert resolve_dtype("off", CPU)[0] is None
    assert resolve_dtype("fp16", CPU)[0] is torch.float16


# /proc/cpuinfo excerpts: the 2-core Xeon the issue was seen on (AVX-512F, no AVX512_BF16: oneDNN emulates
# bf16), a Sapphire Rapids (AMX), an EPYC with AVX512_BF16, a Graviton3 (Arm BF16), an AVX2-only EPYC.
XEON_AVX512F = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n"
EPYC_BF16 = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 avx512_vnni\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"
EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"


@pytest.mark.parametrize("cpuinfo, native", [(XEON_AVX512F, False), (SAPPHIRE, True), (EPYC_BF16, True),
                                             (GRAVITON3, True), (EPYC_AVX2, False), ("", False)])
def test_native_bf16_is_read_from_the_cpus_instruction_flags(tmp_path, monkeypatch, cpuinfo, native):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    # oneDNN says yes on every one of them (it does on AVX-512F alone, by emulation): the flags decide.
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    amp.cpu_has_native_bf16.cache_clear()
    try:
        assert amp.cpu_has_native_bf16(str(path)) is native
        assert amp.cpu_has_native_bf16(str(tmp_path / "missing")) is False  # no /proc/cpuinfo: fp32
    finally:
        amp.cpu_has_native_bf16.cache_clear()


def test_auto_trains_fp32_on_the_avx512f_xeon_and_bf16_with_amx(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    uncached = amp.cpu_has_native_bf16.__wrapped__
    monkeypatch.setattr(amp, "cpu_has_native_bf16", lambda: uncached(str(tmp_path / "cpuinfo")))
    for cpuinfo, dtype in ((XEON_AVX512F, None), (SAPPHIRE, torch.bfloat16)):
        (tmp_path / "cpuinfo").write_text(cpuinfo)
        p = Precision(AmpSection(dtype="auto"), CPU)
        assert p.dtype is dtype
        assert ("no bf16 instructions" in p.note) is (dtype is None)


@pytest.mark.parametrize("choice, dtype, scaling", [("bf16", torch.bfloat16, False),
                                                    ("fp16", torch.float16, True),
                                                    ("off", torch.float32, False)])
def test_one_autocast_context_and_a_scaler_enabled_only_for_fp16(choice, dtype, scaling):
    p = Precision(AmpSection(dtype=choice), CPU)
    lin = torch.nn.Linear(8, 8)
    with p.autocast():
        out = lin(torch.randn(2, 8))
    assert out.dtype == dtype
    assert p.scaler.is_enabled() is scaling


def test_fp16_overflow_skips_the_step_counts_it_and_backs_off_the_scale(make_trainer):
    # A loss scale of 1e20 overflows fp16 gradients in the backward pass: the step must be skipped.
    t = make_trainer("amp.dtype=fp16", "amp.init_scale=1e20")
    before = {n: p.detach().clone() for n, p in t.parts.model.named_parameters()}
    loss = t._step(_batches(t))
    assert math.isfinite(loss.item())  # the forward pass was fine
    assert int(t.parts.progress.skipped) == 1
    assert all(torch.equal(before[n], p) for n, p in t.parts.model.named_parameters())
    assert t.parts.precision.scaler.get_scale() == pytest.approx(0.5e20)


def test_fp16_with_a_sane_scale_updates_the_weights(make_trainer):
    t = make_trainer("amp.dtype=fp16")
    before = {n: p.detach().clone() for n, p in t.parts.model.named_parameters()}
    t._step(_batches(t))
    assert int(t.parts.progress.skipped) == 0
    assert any(not torch.equal(before[n], p) for n, p in t.parts.model.named_parameters())


@pytest.mark.parametrize("choice", ["fp16", "bf16", "off"])
def test_a_short_run_trains_in_each_precision(tmp_path, choice):
    cfg = _cfg(tmp_path, f"amp.dtype={choice}", "train.max_steps=8", "amp.init_scale=1e12")
    summary = rank.run_rank(Torchrun(), cfg)
    assert summary["steps"] == 8 and math.isfinite(summary["final_loss"])
    start = metrics(tmp_path, "start")[0]
    assert start["amp"] == {"fp16": "fp16", "bf16": "bf16", "off": "fp32"}[choice]
    train = metrics(tmp_path, "train")
    if choice == "fp16":
        # The oversized initial scale forces skipped steps; they are counted and logged, and the scale falls.
        assert train[-1]["skipped_steps"] >= 1 and train[-1]["loss_scale"] < 1e12
    else:
        assert "loss_scale" not in train[-1] and train[-1]["skipped_steps"] == 0
