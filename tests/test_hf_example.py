"""examples/hf_causal_lm: a Hugging Face `transformers` GPT-2 (tied embeddings), built from a config, trained
under torchrun by trainapp and exported. `trainapp export` writes a file that loads strictly into a fresh
model of the task, and the task's `export` hook writes `hf/`, which `AutoModelForCausalLM.from_pretrained`
loads into exactly the trained model (fp32 logits bitwise equal); the end of the run exported the same.
transformers is a dev dependency only: without it the module is skipped."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import REPO, torchrun

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed (pip install -e '.[dev]'): "
                                        "the Hugging Face example needs it")]

EXAMPLE = REPO / "examples" / "hf_causal_lm"
ON_PATH = {"PYTHONPATH": str(EXAMPLE)}  # torchrun's workers import the task from there
ARGS = {"arch": "gpt2", "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 64, "val_fraction": 0.01}
RUN = ["task.name=hf_causal_lm_task:CausalLM", *(f"task.args.{k}={v}" for k, v in ARGS.items()),
       "amp.dtype=off", "train.progress=false", "train.max_steps=6", "train.batch_size=8",
       "train.log_every=2", "optim.name=adamw", "optim.lr=0.01", "sched.warmup_steps=0"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """(run directory, `trainapp export` directory) of a 6-step GPT-2 run on 2 ranks. The export runs in
    this process (the command line's `cli.main`): it shares the test's import of transformers, a third
    of the test's time on 2 CPU cores."""
    from trainapp import cli

    root = tmp_path_factory.mktemp("hf")
    run_dir, out = root / "run", root / "out"
    r = torchrun(2, f"run.dir={run_dir}", *RUN, env=ON_PATH, timeout=240)
    assert r.returncode == 0, r.output[-3000:]
    assert "trainapp: done steps=6" in r.stdout and "val_loss=" in r.stdout, r.stdout[-2000:]
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLE))
        assert cli.main(["export", str(run_dir), "--out", str(out)]) == 0
    return run_dir, out


@pytest.fixture
def task(monkeypatch):
    """The example's task, as the run made it; its package on this process's path, where
    `trainapp.load_model` imports it by the run's `task.name`."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from hf_causal_lm_task import CausalLM

    return CausalLM(**ARGS)


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _ids():
    """A fixed batch: two blocks of 32 bytes (the run's block_size)."""
    import torch

    text = b"Call me Ishmael. Some years ago, the whale! cried Ahab, and he was gone."
    return torch.tensor(list(text[:64])).view(2, 32)


def test_the_export_stores_gpt2s_tied_embedding_once_and_loads_strictly_into_a_fresh_model(exported, task):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_model

    import trainapp

    _, out = exported
    record = json.loads((out / "trainapp.json").read_text())
    assert record["check"]["outputs"]["passed"] and record["check"]["outputs"]["equal"], record["check"]
    assert (record["tied"] == {"transformer.wte.weight": "lm_head.weight"}
            and record["task_export"] == "run"), record
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" in f.keys() and "transformer.wte.weight" not in f.keys()
    torch.manual_seed(1234)  # other weights than the run's seed gives: the load must replace every one
    fresh = task.model(None).eval()
    missing, unexpected = load_model(fresh, out / "model.safetensors", strict=True)
    assert not missing and not unexpected, (missing, unexpected)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still one tensor
    snapshot = trainapp.load_model(exported[0])  # the run's newest snapshot, read by trainapp's own reader
    assert torch.equal(_logits(fresh, _ids()), _logits(snapshot, _ids()))


def test_from_pretrained_gives_the_trained_models_logits_exactly(exported, task):
    import torch
    from transformers import AutoModelForCausalLM

    import trainapp

    run_dir, out = exported
    trained = trainapp.load_model(out)
    snapshot = trainapp.load_model(run_dir)
    hf = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert hf.dtype == torch.float32 and hf.lm_head.weight is hf.transformer.wte.weight
    want = _logits(snapshot, _ids())
    assert torch.equal(_logits(trained, _ids()), want)
    assert torch.equal(_logits(hf, _ids()), want)


def test_the_end_of_run_export_has_the_hugging_face_directory_too(exported, task):
    import torch
    from transformers import AutoModelForCausalLM

    import trainapp

    run_dir, out = exported
    record = json.loads((run_dir / "model" / "trainapp.json").read_text())
    assert (record["task_export"] == "run"
            and record["tied"] == {"transformer.wte.weight": "lm_head.weight"}), record
    assert {p.name for p in (run_dir / "model" / "hf").iterdir()} >= {"config.json", "model.safetensors"}
    hf = AutoModelForCausalLM.from_pretrained(run_dir / "model" / "hf").eval()
    # the final step's weights
    assert torch.equal(_logits(hf, _ids()), _logits(trainapp.load_model(out), _ids()))
