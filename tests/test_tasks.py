"""The task API (docs/your-own-model.md): a user's own task, not trainapp's, under every launcher and
fault. Bad tasks get one line naming what is wrong and exit 2; a good one trains, resumes bitwise
after a SIGKILLed rank, keeps its own state across snapshots and fails like any run when its code
raises. The built-in char_lm task and the examples/ template are trained here too."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import (PY, REPO, TORCHRUN, USERTASKS, auto_resumed, inspect, metrics, one_error_line, run_cmd,
                     torchrun2, torchrun_cmd, trainapp)

from trainapp import cli
from trainapp.snapshots.store import load_state, newest_valid

EXAMPLE = REPO / "examples" / "tabular"
SHORT = ["train.progress=false", "train.max_steps=6", "train.batch_size=8", "train.log_every=2",
         "snapshot.every_steps=3"]
# A run with every stateful part (accumulation, EMA, evaluation, snapshots every 5 steps), killed at 13.
FAULT = ["train.max_steps=24", "train.epochs=20", "snapshot.every_steps=5", "train.grad_accum=2",
         "train.ema_decay=0.9", "train.eval_every=10", "train.progress=false", "train.log_every=5"]
CHAR_LM = ["task.name=char_lm", "task.args.n_embd=32", "task.args.n_layer=1", "task.args.block_size=32",
           "task.args.stride=64", "train.batch_size=16"]
TABULAR = ["task.name=tabular_task:Regression", "task.args.hidden=32", "task.args.train_rows=2048",
           "optim.name=adamw", "optim.lr=0.003"]


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(USERTASKS))


def train_here(capsys, tmp_path, *args) -> tuple[int, str]:
    """`trainapp train ARGS` in this process; (exit code, stderr)."""
    code = cli.main(["train", f"run.dir={tmp_path / 'run'}", *SHORT, *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name,args,expected", [
    ("usertasks_probe:Nope", [], "usertasks_probe.py) has no attribute Nope"),
    ("usertasks_probe:NOT_CALLABLE", [], "NOT_CALLABLE is a int, not callable"),
    ("usertasks_probe:make", ["task.args.hidden=64"], "cannot be called with them (got an unexpected "
                                                      "keyword argument 'hidden'); its parameters are "
                                                      "(rows: int = 256)"),
    ("usertasks_probe:Needy", [], "cannot be called with them (missing a required argument: 'width')"),
    ("usertasks_probe:Good", ["task.args.rows=4"], "rejected them (ValueError: rows=4: need at least 16)"),
    ("usertasks_probe:NoEvaluate", [], "has no evaluate method"),
    ("usertasks_probe:UnitsList", [],
     "the task's shard_units is a list, not a method; the optional methods are"),
    ("usertasks_probe:NoLen", [], "a train set without len()"),
    ("usertasks_probe:VectorLoss", [], "returned a tensor of shape (8,); it must return a scalar"),
    ("usertasks_probe:DetachedLoss", [], "returned a tensor without grad"),
    ("usertasks_probe:NoCount", [], "returned keys ['mse']; it must return a dict of sums"),
    ("usertasks_probe:Ragged", [], "of the train set is a float32 tensor of shape ("),
    ("usertasks_probe:Ragged", ["data.num_workers=1"], "of the train set is a float32 tensor of shape ("),
    ("no_such_module_xyz.tasks:Task", [], "cannot import no_such_module_xyz.tasks (ModuleNotFoundError"),
    ("usertasks_probe:NumpyState", [], "no snapshot of this run could be resumed: its "
                                       "task['norm']['mean'] is a numpy.ndarray, which "
                                       "torch.load(weights_only=True) will not load"),
    ("usertasks_probe:ExtraState", [], "its model['2._extra_state'] is a types.Settings, which torch.save "
                                       "cannot write"),
])
def test_a_bad_task_is_one_line_naming_it_and_exit_2(on_path, capsys, tmp_path, name, args, expected):
    code, err = train_here(capsys, tmp_path, f"task.name={name}", *args)
    assert code == 2, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("trainapp train: error: task.") and expected in line, line
    assert "Traceback" not in err


def test_a_module_that_fails_to_import_is_named_with_its_own_error(capsys, tmp_path, monkeypatch):
    (tmp_path / "brokentask_mod.py").write_text("import torch\nraise RuntimeError('needs CUDA 13 here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = train_here(capsys, tmp_path, "task.name=brokentask_mod:Task")
    assert code == 2
    assert "cannot import brokentask_mod (RuntimeError: needs CUDA 13 here)" in err.strip().splitlines()[-1]


def test_the_ray_driver_checks_the_task_before_anything_starts(tmp_path):
    r = trainapp("ray", "task.name=usertasks_probe:NoEvaluate", f"ray.storage_path={tmp_path}",
                 env={"PYTHONPATH": str(USERTASKS)}, timeout=60)
    one_error_line(r, "ray", "task.name='usertasks_probe:NoEvaluate'")
    assert "ray.init" not in r.output


def test_the_tasks_own_state_is_in_every_snapshot_and_resumes(on_path, capsys, tmp_path):
    code, err = train_here(capsys, tmp_path, "task.name=usertasks_probe:Counting", "train.grad_accum=2")
    assert code == 0, err[-2000:]
    code, err = train_here(capsys, tmp_path, "task.name=usertasks_probe:Counting", "train.grad_accum=2",
                           "train.max_steps=9")
    assert code == 0, err[-2000:]
    start = metrics(tmp_path / "run", "start")[-1]
    assert start["resumed_step"] == 6
    state = load_state(newest_valid(tmp_path / "run" / "snapshots")[0])
    assert state["task"] == {"seen": 18}  # 9 steps of 2 micro-batches: the resumed run counted on from 12
    (ev,) = [e for e in metrics(tmp_path / "run", "eval") if e["step"] == 9]
    assert ev["val_count"] == 32 and ev["val_mse"] >= 0 and set(ev) >= {"val_mse", "val_count", "step"}


def test_task_state_that_a_snapshot_would_not_load_back_later_stops_at_that_snapshot(on_path, capsys,
                                                                                      tmp_path):
    """A running mean that becomes a numpy array after the start's check: the first storage snapshot is
    refused in one line (exit 2) instead of being written, so no snapshot of the run is unloadable."""
    code, err = train_here(capsys, tmp_path, "task.name=usertasks_probe:LateNumpy", "snapshot.every_steps=3")
    assert code == 2, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert "its task['norm']['mean'] is a numpy.ndarray" in line and "Traceback" not in err, err[-2000:]
    assert not list((tmp_path / "run" / "snapshots").glob("step_*"))


def test_a_user_exception_in_loss_mid_run_is_a_failure_record_with_rank_step_and_phase(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cmd([*torchrun_cmd(2), f"run.dir={run_dir}", *SHORT, "task.name=usertasks_probe:Counting",
                 "task.args.fail_at=4"], env={"PYTHONPATH": str(USERTASKS)})  # torchrun's workers inherit it
    assert r.returncode != 0
    assert "RuntimeError: user bug in loss at call 4" in r.stderr and "usertasks_probe.py" in r.stderr
    fails = [f for f in metrics(run_dir, "failure") if f.get("cause") != "peer"]
    assert fails and {f["step"] for f in fails} == {3} and {f["phase"] for f in fails} == {"compute"}, fails
    assert "user bug in loss" in fails[0]["error"]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["example", pytest.param("char_lm", marks=pytest.mark.e2e),
                                   pytest.param("example-fsdp", marks=pytest.mark.e2e)])
def test_a_non_image_task_resumes_bitwise_after_a_sigkilled_rank_under_torchrun(straight_run, tmp_path,
                                                                                which):
    # example-fsdp: the user's model sharded by the default units, gathered in bf16, with an EMA copy
    fsdp = ["parallel.strategy=fsdp", "parallel.fsdp_param_dtype=amp", "amp.dtype=bf16",
            "train.ema_decay=0.9"]
    args = {"example": TABULAR, "char_lm": CHAR_LM, "example-fsdp": [*TABULAR, *fsdp]}[which]
    env = {"PYTHONPATH": str(EXAMPLE)}
    clean, faulty = straight_run(torchrun2, *FAULT, *args, env=env), tmp_path / "faulty"
    r = run_cmd(torchrun2(faulty, *FAULT, *args, "drill.kill_at_step=13", "drill.rank=1"), env=env)
    assert r.returncode == 0, r.output[-3000:]
    # The memory tier (the default, `auto`: a copy every 4 or 5 steps here alone) resumes it where its copy
    # is at least as new as the storage snapshot of step 10; under load its cadence may leave storage newer.
    start = metrics(faulty, "start")[-1]
    assert (start["resumed_tier"], start["resumed_step"]) == auto_resumed(r.output, 10, 13), start
    a, b = inspect(clean), inspect(faulty)
    assert a["global_step"] == b["global_step"] == 24 and a["params_sha256"] == b["params_sha256"]
    assert b["task"] != "image_classification" and b["model"] is None  # not the image task's model.name
    done = [line for line in r.stdout.splitlines() if line.startswith("trainapp: done")][0]
    assert ("val_bpc=" in done and "val_loss=" in done) if which == "char_lm" else ("val_mse=" in done), done


# --- every fault feature on a task that is not images -----------------------------------------------

LONG = [*TABULAR, "train.epochs=100", "train.max_steps=60", "snapshot.every_steps=10", "train.progress=false",
        "train.log_every=5"]
ON_PATH = {"PYTHONPATH": str(EXAMPLE)}


@pytest.mark.e2e
def test_a_sigterm_preempted_user_task_resumes_with_zero_steps_redone_bitwise(straight_run, tmp_path):
    from test_preempt import Job

    # dropout: the model draws random numbers every step
    args = [*TABULAR, "train.epochs=100", "train.max_steps=200", "snapshot.every_steps=100",
            "train.progress=false", "train.log_every=5", "task.args.dropout=0.2"]
    straight = straight_run(_alone, *args, env=ON_PATH)
    run_dir = tmp_path / "run"
    job = Job(["env", f"PYTHONPATH={EXAMPLE}", *_alone(run_dir, *args)], tmp_path, "alone")
    rc = job.signal_after(run_dir, "train", 60, job.proc.pid)
    assert rc == 143, job.output()[1][-3000:]
    (rec,) = metrics(run_dir, "preempted")
    assert rec["step"] % 100 and inspect(run_dir)["global_step"] == rec["step"]  # between periodic snapshots
    r = run_cmd(_alone(run_dir, *args), env=ON_PATH)
    assert r.returncode == 0, r.output[-3000:]
    start = metrics(run_dir, "start")[-1]
    assert start["resumed_step"] == rec["step"] == start["step"]  # zero steps redone
    assert inspect(run_dir)["params_sha256"] == inspect(straight)["params_sha256"]


@pytest.mark.e2e
def test_a_hung_rank_of_a_user_task_is_found_and_the_restart_resumes_bitwise(straight_run, tmp_path):
    straight, run_dir = straight_run(torchrun2, *LONG, env=ON_PATH), tmp_path / "run"
    r = run_cmd(torchrun2(run_dir, *LONG, "drill.hang_at_step=25", "drill.rank=1", "fault.hang_timeout_s=5"),
                env=ON_PATH)
    assert r.returncode == 0, r.output[-3000:]
    failures = {f["rank"]: f for f in metrics(run_dir, "failure")}
    assert failures[1]["cause"] == "hang" and failures[1]["step"] == 25, failures
    start = metrics(run_dir, "start")[-1]  # the memory tier (the default) or the storage snapshot of step 20
    assert (start["resumed_tier"], start["resumed_step"]) == auto_resumed(r.output, 20, 25), start
    assert inspect(run_dir)["params_sha256"] == inspect(straight)["params_sha256"]


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")
def test_a_full_disk_under_a_user_task_stops_after_max_failures_with_exit_3(tmp_path):
    run_dir = tmp_path / "run"
    snaps = run_dir / "snapshots"
    snaps.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(snaps)], check=True)
    try:
        r = run_cmd(_alone(run_dir, *LONG, "snapshot.every_steps=5"), env=ON_PATH)
    finally:
        subprocess.run(["umount", "-l", str(snaps)], check=False)
    assert r.returncode == 3, r.output[-3000:]
    assert "snapshot.max_failures=3: 3 snapshots in a row failed" in r.stderr
    assert [f["errno"] for f in metrics(run_dir, "snapshot_failed")] == ["ENOSPC"] * 3
    assert metrics(run_dir, "train")  # training went on between the failed snapshots


@pytest.mark.e2e
def test_a_slowed_rank_of_a_user_task_is_named_a_straggler(tmp_path):
    r = run_cmd([*torchrun_cmd(2), f"run.dir={tmp_path}", *LONG, "drill.slow_rank=1", "drill.slow_ms=60",
                 "observe.straggler_intervals=3", "train.max_steps=30"], env=ON_PATH)
    assert r.returncode == 0, r.output[-3000:]
    (found,) = metrics(tmp_path, "straggler")
    assert (found["rank"], found["phase"]) == (1, "compute") and found["intervals"] == 3, found


def _alone(run_dir: Path, *args: str) -> list[str]:
    return [PY, "-m", "trainapp", "train", f"run.dir={run_dir}", *args]


@pytest.mark.e2e
def test_a_script_of_its_own_trains_its_task_object_under_torchrun(tmp_path):
    """examples/tabular/train.py: `trainapp.main(Regression(hidden=64))`, its arguments trainapp's."""
    script = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(EXAMPLE / "train.py"),
              "--config", str(EXAMPLE / "config.yaml"), f"run.dir={tmp_path}", "train.max_steps=12",
              "train.progress=false", "train.eval_every=0"]
    r = run_cmd(script, env=ON_PATH)
    assert r.returncode == 0, r.output[-3000:]
    assert "trainapp: done steps=12" in r.stdout and "val_mse=" in r.stdout and "world_size=2" in r.stdout
    task = metrics(tmp_path, "start")[0]["config"]["task"]
    # the object's class; its args are its own
    assert task == {"name": "tabular_task.task:Regression", "args": {}}
    r = run_cmd([*script, "task.args.hidden=8"], env=ON_PATH)
    assert r.returncode != 0 and "task.args={'hidden': 8}: the task comes made by the script" in r.stderr
