"""`parallel.compile` and `parallel.activation_checkpoint` (trainapp/core/parallel/): a compiled run whose
rank was SIGKILLed ends bitwise equal to its straight compiled twin, and a resume on a node with an empty
local compile cache (at another world size) compiles nothing: the carried cache is unpacked first; a
damaged or foreign carried cache is one warning and a cold compile; a graph break is named in one
warning; no C++ compiler is one line before anything is built; activation checkpointing is the same math
with less activation memory. How long a warm restart's first step takes: bench/compile.py."""

from __future__ import annotations

import io
import logging
import re
import tarfile
from pathlib import Path

import pytest
import torch
from helpers import QUICK, inspect, metrics, one_error_line, run_cmd, torchrun2, trainapp

from trainapp.core.parallel import checkpointing
from trainapp.core.parallel.compile_cache import CompileCache, _unpack

# A small transformer with dropout (checkpointing must replay its masks), evaluated at the end only.
LM = ["task.name=char_lm", "task.args.n_layer=2", "task.args.n_embd=32", "task.args.block_size=32",
      "task.args.dropout=0.1", "train.batch_size=16", *QUICK]
COMPILED = [*LM, "parallel.compile=true", "train.max_steps=16", "train.epochs=10", "snapshot.every_steps=5",
            "train.log_every=1", "snapshot.memory_every_steps=0"]  # resumed by the storage tier
LINE = re.compile(r"parallel\.compile: (\d+) graphs by the first step; inductor's cache (\d+) hits, (\d+) "
                  r"compiled; AOTAutograd's (\d+) hits, (\d+) compiled")


def _counts(output: str) -> list[tuple[int, ...]]:
    """Each attempt's line after its first step: (graphs, inductor hits, compiled, AOT hits, compiled)."""
    return [tuple(int(g) for g in m.groups()) for m in LINE.finditer(output)]


def _env(local: Path) -> dict[str, str]:
    return {"TORCHINDUCTOR_CACHE_DIR": str(local)}


@pytest.mark.slow
def test_a_compiled_run_resumes_a_killed_rank_bitwise_and_restarts_warm_on_an_empty_local_cache(
        straight_run, tmp_path):
    run, cold, fresh = tmp_path / "run", tmp_path / "local-cold", tmp_path / "local-fresh"
    r = run_cmd(torchrun2(run, *COMPILED, "drill.kill_at_step=13", "drill.rank=1"), timeout=600,
                env=_env(cold))
    assert r.returncode == 0, r.output[-3000:]
    straight = straight_run(torchrun2, *COMPILED, env=_env(cold))  # warm: the math is the same, cheaper
    assert inspect(run)["params_sha256"] == inspect(straight)["params_sha256"]
    starts = metrics(run, "start")
    assert [s["resumed_step"] for s in starts] == [None, 10]
    first, second = (s["parallel"]["compile"] for s in starts)
    assert first["units"] == ["pos", "blocks.0", "blocks.1", "ln"] and first["cache"]["files"] == 0, first
    assert second["cache"]["files"] > 0, second  # the restart found the cache attempt 1 carried
    counts = _counts(r.output)
    assert len(counts) == 2 and counts[0][2] > 0, counts  # attempt 1 compiled its graphs

    # Resumed alone (another world size, the same graphs) with an empty local cache: every compiled file
    # comes from the carried one, unpacked before the compile, and inductor compiles nothing.
    carried = _unpack(next((run / "compile").iterdir()).read_bytes())[1]
    names = set(tarfile.open(fileobj=io.BytesIO(carried)).getnames())
    # A fresh interpreter, as inductor's settings and compile workers are made once per process.
    r = trainapp("train", f"run.dir={run}", *COMPILED, "train.max_steps=19", timeout=600, env=_env(fresh),
                 fresh=True)
    assert r.returncode == 0, r.output[-3000:]
    resumed = metrics(run, "start")[-1]
    assert resumed["resumed_step"] == 16 and resumed["world_size"] == 1
    cache = resumed["parallel"]["compile"]["cache"]
    assert cache["files"] == len(names) and cache["new_here"] == len(names), cache
    assert "loaded the carried compile cache" in r.stderr
    (graphs, fx_hits, fx_compiled, aot_hits, aot_compiled), = _counts(r.output)
    assert graphs > 0 and fx_compiled == 0 and aot_compiled == 0 and aot_hits > 0, _counts(r.output)
    kernels = {p.relative_to(fresh).as_posix() for p in fresh.rglob("*.so")}
    assert kernels and kernels <= names, kernels - names


@pytest.mark.slow
@pytest.mark.e2e
def test_a_compiled_fsdp_run_resumes_a_killed_rank_bitwise(straight_run, tmp_path):
    """Each unit compiled, then sharded: FSDP's gathers run around the compiled forwards."""
    fsdp = [*COMPILED, "parallel.strategy=fsdp", "snapshot.keep=10"]
    r = run_cmd(torchrun2(tmp_path, *fsdp, "drill.kill_at_step=13", "drill.rank=1"), timeout=600)
    assert r.returncode == 0, r.output[-3000:]
    assert [s["resumed_step"] for s in metrics(tmp_path, "start")] == [None, 10]
    assert metrics(tmp_path, "start")[0]["parallel"]["strategy"] == "fsdp"
    assert inspect(tmp_path)["params_sha256"] == inspect(straight_run(torchrun2, *fsdp))["params_sha256"]


def _cache(tmp_path: Path) -> CompileCache:
    return CompileCache(tmp_path / "run", torch.device("cpu"), is_main=True)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other torch"])
def test_a_damaged_or_foreign_carried_cache_is_one_warning_and_a_cold_compile(tmp_path, caplog, damage):
    cache = _cache(tmp_path)
    cache.path.parent.mkdir(parents=True)
    (cache.local / "trainapp-test").mkdir(parents=True, exist_ok=True)
    (cache.local / "trainapp-test" / f"kernel-{damage[:5]}.so").write_bytes(b"\x7fELF compiled")
    cache._write(cache._pack(), graphs=1)  # a good file first, then damaged
    good = cache.path.read_bytes()
    cache.path.write_bytes({"garbage": b"\x00" * 100, "truncated": good[:-10],
                            "other torch": good.replace(torch.__version__.encode(), b"2.0.0", 1)}[damage])
    with caplog.at_level(logging.INFO, logger="trainapp"):
        said = _cache(tmp_path).load()
    assert said["files"] == 0 and said["why"], said
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("trainapp")]
    assert len(warnings) == 1 and "was not loaded" in warnings[0].getMessage(), caplog.text
    assert {"garbage": "not a trainapp compile cache", "truncated": "digest",
            "other torch": "written by torch 2.0.0"}[damage] in warnings[0].getMessage()


def test_a_carried_file_outside_the_cache_is_refused(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    cache = _cache(tmp_path)
    cache._write(buf.getvalue(), graphs=1)
    assert "no file of a cache" in _cache(tmp_path).load()["why"]
    assert not (cache.local.parent.parent / "escaped").exists()


def test_without_a_cpp_compiler_compile_is_refused_in_one_line(tmp_path):
    r = trainapp("train", f"run.dir={tmp_path}", *LM, "parallel.compile=true",
                 env={"CXX": str(tmp_path / "no-such-compiler")}, fresh=True)  # inductor reads CXX at import
    line = one_error_line(r, "train", "parallel.compile=true")
    assert "no-such-compiler" in line and "parallel.compile=false" in line, line
    assert not (tmp_path / "snapshots").exists()


class _Breaks(torch.nn.Module):
    """A model a user might bring: one call dynamo cannot trace (a host round trip) inside a unit."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x):
        h = self.a(x)
        _host_side(h)
        return self.b(h)


@torch.compiler.disable
def _host_side(h):  # torch's own way to keep a part eager, and a graph break where it is called
    return h.sum().item()


@pytest.mark.slow  # compiles in this process (half a minute on a slow CPU)
def test_a_graph_break_is_named_in_one_warning_and_the_model_still_trains(caplog):
    from types import SimpleNamespace

    from trainapp.config import ParallelSection
    from trainapp.core.parallel.strategy import Strategy
    from trainapp.observe.timings import PhaseClock

    model = torch.nn.Sequential(_Breaks())
    ctx = SimpleNamespace(device=torch.device("cpu"), is_main=True, distributed=False)
    strategy = Strategy(ParallelSection(compile=True), ctx)
    strategy.prepare(model)
    model(torch.randn(2, 4)).sum().backward()
    with caplog.at_level(logging.INFO, logger="trainapp"):
        strategy.after_step(model, PhaseClock(ctx.device, False, lambda phase: None))
        strategy.after_step(model, PhaseClock(ctx.device, False, lambda phase: None))
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.name.startswith("trainapp")]
    assert len(warnings) == 1 and "graph break" in warnings[0] and "test_compile.py" in warnings[0], warnings
    assert all(p.grad is not None for p in model.parameters())


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """The bytes a training forward keeps for its backward (the activation memory)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).float().square().mean()
    loss.backward()
    return total


def test_activation_checkpointing_keeps_a_fraction_of_the_activations_and_changes_no_gradient():
    from trainapp.tasks.char_lm import CharTransformer

    def made(checkpointed: bool):
        torch.manual_seed(0)
        m = CharTransformer(40, 256, 4, 4, 64, dropout=0.1)
        if checkpointed:
            checkpointing.checkpoint(list(m.blocks))
        return m

    x = torch.randint(0, 40, (4, 256))
    plain, ckpt = made(False), made(True)
    torch.manual_seed(1)
    full = _saved_bytes(plain, x)
    torch.manual_seed(1)
    kept = _saved_bytes(ckpt, x)
    assert kept < 0.6 * full, (kept, full)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), name  # the same dropout masks replayed: the same gradients


@pytest.mark.slow
def test_activation_checkpointing_trains_bitwise_the_same_run_under_ddp(straight_run, tmp_path):
    run = [*LM, "train.max_steps=6", "snapshot.every_steps=0"]
    r = run_cmd(torchrun2(tmp_path, *run, "parallel.activation_checkpoint=full"))
    assert r.returncode == 0, r.output[-3000:]
    assert metrics(tmp_path, "start")[0]["parallel"]["activation_checkpoint"] == {"mode": "full", "units": 4}
    assert inspect(tmp_path)["params_sha256"] == inspect(straight_run(torchrun2, *run))["params_sha256"]
