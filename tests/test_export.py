"""A run's model out and in (docs/export.md): `trainapp export` from whole (DDP) and sharded (FSDP)
snapshots, the end-of-run export, `trainapp.load_model`, and `init.from` starting a run from weights, with
every bad input one line. Runs are shared with other files (conftest.py's `torchrun_restarted`, a DDP run
with EMA, and `fsdp_straight`); the Hugging Face example's round trip is tests/test_hf_example.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap

import pytest
import torch
from helpers import FAULT_RUN, PY, REPO, inspect, metrics, torchrun, trainapp
from safetensors.torch import load_file, load_model

import trainapp as ta
from trainapp import cli
from trainapp.errors import ConfigError
from trainapp.snapshots import store
from trainapp.tasks.image import SmallCNN
from trainapp.weights import init
from trainapp.weights.artifact import ArtifactDir, plan, write_state
from trainapp.weights.safetensors_file import file_digest
from trainapp.weights.sources import open_source

pytestmark = pytest.mark.slow


def export(*args: str):
    r = trainapp("export", *args, timeout=180)
    assert r.returncode == 0, r.output[-3000:]
    return r


def record(out) -> dict:
    return json.loads((out / "trainapp.json").read_text())


def snapshot_model(snap, part: str = "model") -> dict[str, torch.Tensor]:
    """The weights a snapshot holds, by trainapp's own readers (the whole state, or the shards merged)."""
    state = store.load_state(snap)
    tensors = store.full_sharded_model(snap, part) if isinstance(state[part], str) else state[part]
    return {k.removeprefix("module.") if part == "ema" else k: v
            for k, v in tensors.items() if k != "n_averaged"}


def newest(run):
    return store.list_snapshots(run / "snapshots")[-1]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_an_export_of_a_whole_or_sharded_snapshot_loads_strictly_into_the_plain_model_with_equal_tensors(
        kind, torchrun_restarted, fsdp_straight, tmp_path):
    run = torchrun_restarted if kind == "ddp" else fsdp_straight
    out = tmp_path / "out"
    export(str(run), "--out", str(out))
    model = SmallCNN(num_classes=10)
    # safetensors' own loader, nothing of trainapp
    load_model(model, str(out / "model.safetensors"), strict=True)
    want = snapshot_model(newest(run))
    assert sorted(model.state_dict()) == sorted(want)
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)
    rec = record(out)
    assert rec["params_sha256"] == inspect(run)["params_sha256"], (rec["params_sha256"], inspect(run))
    assert (rec["step"] == 24
            and rec["source"]["kind"] == ("snapshot" if kind == "ddp" else "sharded snapshot"))
    assert rec["check"]["outputs"]["passed"] and rec["check"]["outputs"]["equal"], rec["check"]
    assert rec["task"]["name"] == "image_classification" and rec["config"]["train"]["max_steps"] == 24
    assert rec["tensors_sha256"] == file_digest(out / "model.safetensors")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_inspect_merges_a_sharded_snapshot_without_room_in_the_temp_directory(fsdp_straight, small_tmpfs):
    """`trainapp inspect` reads every rank's shard straight into the model's tensors: a temp directory
    with room for less than the snapshot (TMPDIR a 64 KiB tmpfs; a full one Python's tempfile would pass
    over) changes nothing."""
    shards = newest(fsdp_straight) / store.SHARDS
    assert sum(p.stat().st_size for p in shards.iterdir()) > 64 * 1024  # a merged copy would not fit
    r = trainapp("inspect", str(fsdp_straight), env={"TMPDIR": str(small_tmpfs)})
    assert r.returncode == 0, r.output[-3000:]
    assert json.loads(r.stdout)["params_sha256"] == inspect(fsdp_straight)["params_sha256"]


def test_ema_exports_the_averaged_weights_and_bf16_halves_the_file(fsdp_straight, tmp_path):
    ema, half = tmp_path / "ema", tmp_path / "bf16"
    export(str(fsdp_straight), "--out", str(ema), "--ema")
    export(str(fsdp_straight), "--out", str(half), "--dtype", "bf16", "--step", "20")
    averaged, plain = load_file(ema / "model.safetensors"), snapshot_model(newest(fsdp_straight))
    want = snapshot_model(newest(fsdp_straight), "ema")
    assert all(torch.equal(averaged[k], want[k]) for k in want) and record(ema)["ema"] is True
    assert any(not torch.equal(averaged[k], plain[k]) for k in plain)
    ratio = (half / "model.safetensors").stat().st_size / (ema / "model.safetensors").stat().st_size
    assert 0.45 < ratio < 0.55, ratio
    tensors = load_file(half / "model.safetensors")
    assert {t.dtype for k, t in tensors.items() if "num_batches_tracked" not in k} == {torch.bfloat16}
    check = record(half)["check"]["outputs"]
    assert (record(half)["step"] == 20 and check["passed"]
            and 0 < check["rel_l2"] < check["tolerance_rel_l2"]), check


def test_a_killed_and_resumed_run_exports_byte_equal_tensors_to_its_straight_twin(torchrun_restarted,
                                                                                  torchrun_straight):
    """`run.export` at the end of both runs (the EMA copy: the runs keep one), from the model in memory."""
    a, b = torchrun_straight / "model", torchrun_restarted / "model"
    assert load_file(a / "model.safetensors").keys() == load_file(b / "model.safetensors").keys()
    assert record(a)["tensors_sha256"] == record(b)["tensors_sha256"]
    assert (record(b)["ema"] is True and record(b)["step"] == 24
            and record(b)["written_by"] == "the end of the run")
    want = snapshot_model(newest(torchrun_restarted), "ema")
    got = load_file(b / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert metrics(torchrun_restarted, "end")[-1]["model"] == str(b)


def test_load_model_gives_the_tasks_module_in_eval_mode_with_the_weights(torchrun_restarted):
    model = ta.load_model(torchrun_restarted / "model")
    assert isinstance(model, SmallCNN) and not model.training
    got, want = model.state_dict(), load_file(torchrun_restarted / "model" / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.e2e
def test_init_from_starts_lower_and_a_killed_fine_tune_resumes_its_own_snapshot_bitwise(torchrun_restarted,
                                                                                        tmp_path):
    """A run started from an export: its first logged loss is lower than the same run's from scratch
    (`torchrun_restarted` is that run); killed and restarted, it resumes its own snapshot (not the
    export) and ends bitwise equal to its straight twin."""
    source = torchrun_restarted / "model"
    args = [*FAULT_RUN, f"init.from={source}", "train.log_every=1"]
    tuned, killed = tmp_path / "tuned", tmp_path / "killed"
    assert torchrun(2, f"run.dir={tuned}", *args).returncode == 0
    r = torchrun(2, f"run.dir={killed}", *args, "drill.kill_at_step=13", "drill.rank=1", max_restarts=1)
    assert r.returncode == 0, r.output[-3000:]
    first = metrics(tuned, "train")[0]
    assert first["step"] == 1 and first["loss"] < metrics(torchrun_restarted, "train")[0]["loss"], first
    starts = metrics(killed, "start")
    assert [s["resumed_step"] for s in starts] == [None, 10]
    assert starts[0]["init"]["path"].endswith("model.safetensors") and starts[0]["init"]["kind"] == "export"
    assert starts[1]["init"] == starts[0]["init"]  # what the resumed snapshot says, not read again
    assert "not read: the run resumes its own snapshot" in r.output
    meta = json.loads((newest(killed) / "meta.json").read_text())
    assert meta["init"]["tensors_sha256"] == record(source)["tensors_sha256"]
    assert inspect(killed)["params_sha256"] == inspect(tuned)["params_sha256"]


def here(capsys, *args: str) -> tuple[int, str]:
    """`trainapp ARGS` in this process (a world of one): (exit code, stderr)."""
    code = cli.main(list(args))
    return code, capsys.readouterr().err


def one_line_here(capsys, needle: str, *args: str) -> str:
    code, err = here(capsys, *args)
    lines = [ln for ln in err.splitlines() if ln.startswith(f"trainapp {args[0]}: error:")]
    assert code == 2 and len(lines) == 1 and needle in lines[0], (code, err[-2000:])
    assert "Traceback" not in err
    return lines[0]


def test_bad_export_and_init_input_is_one_line_with_exit_2_and_writes_nothing(torchrun_restarted, capsys,
                                                                              tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    (tmp_path / "empty-run").mkdir()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    data = bytearray((torchrun_restarted / "model" / "model.safetensors").read_bytes())
    data[-100] ^= 0xFF
    (corrupt / "model.safetensors").write_bytes(bytes(data))
    (corrupt / "trainapp.json").write_text((torchrun_restarted / "model" / "trainapp.json").read_text())
    out = tmp_path / "out"
    quick = ["train.max_steps=2", "train.progress=false", "data.train_size=64", "data.val_size=32"]
    cases = [
        (["export", str(tmp_path / "empty-run"), "--out", str(out)], "holds no snapshot"),
        (["export", str(torchrun_restarted), "--out", str(out), "--step", "7"], "--step 7: "),
        (["export", str(torchrun_restarted), "--out", str(tmp_path / "full")], "exists and is not empty"),
        (["train", f"run.dir={tmp_path / 'r1'}", f"init.from={tmp_path / 'nope'}", *quick], "init.from="),
        (["train", f"run.dir={tmp_path / 'r2'}", f"init.from={corrupt}", *quick],
         "do not match trainapp.json"),
        (["train", f"run.dir={tmp_path / 'r3'}", f"init.from={torchrun_restarted / 'model'}",
          "task.name=char_lm", *quick], "init.exclude="),
    ]
    for args, needle in cases:
        one_line_here(capsys, needle, *args)
    assert (tmp_path / "full" / "x").read_text() == "mine"
    assert not out.exists() and not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert not [p for p in tmp_path.glob("r?/snapshots/*")]  # the runs stopped before their first step
    # A run without EMA: --ema names the setting.
    plain = tmp_path / "plain"
    assert here(capsys, "train", f"run.dir={plain}", "run.export=false", *quick)[0] == 0
    assert not (plain / "model").exists()
    one_line_here(capsys, "train.ema_decay was 0", "export", str(plain), "--out", str(out), "--ema")
    assert not out.exists()


def test_an_export_killed_half_way_leaves_no_file_that_looks_complete(torchrun_restarted, tmp_path):
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from trainapp.weights.artifact import ArtifactDir, plan
        state = {{f"w{{i}}": torch.full((1000,), float(i)) for i in range(8)}}
        entries, _ = plan(state, None)
        artifact = ArtifactDir({str(out)!r})
        writer = artifact.writer(entries)
        for e in entries[:4]:
            writer.add(e.name, state[e.name])
        writer._file.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([PY, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not out.exists()
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-out-")]
    assert not (left / "model.safetensors").exists() and list(left.iterdir())  # only the temporary name
    export(str(torchrun_restarted), "--out", str(out), "--no-check")
    assert (out / "model.safetensors").exists() and record(out)["check"]["outputs"].startswith("not run")
    assert not left.exists()  # the next export of that name sweeps it


# ------------------------------------------------------------------------------- in one process


class Tied(torch.nn.Module):
    def __init__(self, head: int = 5):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.out = torch.nn.Linear(4, 11, bias=False)
        self.out.weight = self.emb.weight
        self.head = torch.nn.Linear(4, head)


def written(tmp_path, model: torch.nn.Module, dtype=None):
    artifact = ArtifactDir(tmp_path / "x")
    state = model.state_dict()
    entries, drop = plan(state, dtype)
    write_state(artifact.writer(entries), state)
    return artifact.publish({"tied": drop}), drop


def test_tied_weights_are_stored_once_and_safetensors_load_model_fills_both_names(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    out, drop = written(tmp_path, model)
    assert drop == {"out.weight": "emb.weight"}
    assert sorted(load_file(out / "model.safetensors")) == ["emb.weight", "head.bias", "head.weight"]
    fresh = Tied()
    load_model(fresh, str(out / "model.safetensors"), strict=True)
    assert fresh.out.weight is fresh.emb.weight and torch.equal(fresh.emb.weight, model.emb.weight)


def test_init_misfits_name_the_tensors_and_the_ways_out(tmp_path):
    torch.manual_seed(0)
    out, _ = written(tmp_path, Tied(head=5))
    source = open_source(out, setting="init.from")
    bigger = Tied(head=7)
    with pytest.raises(ConfigError, match=r"another shape: head\.bias \(5,\) vs the model's \(7,\)"
                                          r".*init\.exclude"):
        init.fit(bigger, source, [], strict=True)
    names, skipped = init.fit(bigger, source, ["head"], strict=True)  # a new head: excluded
    assert sorted(names) == ["emb.weight"] and skipped == []
    names, skipped = init.fit(bigger, source, [], strict=False)
    assert sorted(names) == ["emb.weight"] and sorted(skipped) == ["head.bias", "head.weight"]
    init.load_into(bigger, source, names)
    assert torch.equal(bigger.emb.weight, load_file(out / "model.safetensors")["emb.weight"])
    assert bigger.out.weight is bigger.emb.weight


def test_a_truncated_safetensors_file_is_one_line_naming_it(tmp_path):
    out, _ = written(tmp_path, Tied())
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        open_source(f, setting="init.from")


def test_the_writer_refuses_a_tensor_out_of_order(tmp_path):
    artifact = ArtifactDir(tmp_path / "x")
    entries, _ = plan({"a": torch.zeros(2), "b": torch.zeros(3)}, None)
    writer = artifact.writer(entries)
    with pytest.raises(ValueError, match="expected a"):
        writer.add("b", torch.zeros(3))
    writer.abort()
    artifact.abort()
    assert os.listdir(tmp_path) == []


def test_an_fsdp_run_starts_from_another_runs_sharded_snapshot(fsdp_straight, torchrun_restarted, tmp_path):
    """`init.from` a run directory whose newest snapshot is sharded (read in each process, at any world
    size) into a run that shards its model after the weights are in."""
    run = tmp_path / "ft"
    r = torchrun(2, f"run.dir={run}", "parallel.strategy=fsdp", "train.max_steps=3", "train.log_every=1",
                 "train.progress=false", "data.train_size=1024", "data.val_size=256",
                 f"init.from={fsdp_straight}")
    assert r.returncode == 0, r.output[-3000:]
    (start,) = metrics(run, "start")
    assert start["init"]["kind"] == "sharded snapshot" and start["init"]["step"] == 24, start["init"]
    assert start["init"]["loaded"] == len(snapshot_model(newest(fsdp_straight))), start["init"]
    assert metrics(run, "train")[0]["loss"] < metrics(torchrun_restarted, "train")[0]["loss"]
