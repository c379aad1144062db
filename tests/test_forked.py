"""The tests' forked `python -m trainapp` (tests/forked.py) behaves as a fresh interpreter would: the
same lines and parameters, the same errors for what only the test's own process could import, the
same exit code for a process killed by a signal."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import QUICK, REPO, inspect, one_error_line, torchrun, trainapp

pytestmark = pytest.mark.slow


def _lines(output: str, run_dir: str) -> list[str]:
    """The output with numbers and the run's directory taken out: what a run says, not when or how fast."""
    return re.sub(r"[0-9.]+", "N", output.replace(run_dir, "RUN")).splitlines()


def test_a_forked_run_says_and_trains_what_a_fresh_interpreters_does(tmp_path):
    args = ["train.max_steps=6", *QUICK, "train.log_every=1"]
    forked = trainapp("train", f"run.dir={tmp_path / 'forked'}", *args)
    fresh = trainapp("train", f"run.dir={tmp_path / 'fresh'}", *args, fresh=True)
    assert forked.returncode == fresh.returncode == 0, (forked.output[-2000:], fresh.output[-2000:])
    assert "step=6" in forked.stderr
    assert _lines(forked.output, str(tmp_path / "forked")) == _lines(fresh.output, str(tmp_path / "fresh"))
    assert inspect(tmp_path / "forked")["params_sha256"] == inspect(tmp_path / "fresh")["params_sha256"]


def test_a_forked_run_imports_only_what_its_own_path_holds(tmp_path):
    """The test's process has tests/usertasks on its `sys.path` (helpers.py); a fresh interpreter does not
    without PYTHONPATH, and neither does the forked child."""
    args = ["train", f"run.dir={tmp_path}", "task.name=usertasks_stream:StreamLedger"]
    lines = {one_error_line(trainapp(*args, fresh=fresh), "train", "cannot import usertasks_stream")
             for fresh in (False, True)}
    assert len(lines) == 1, lines


def test_a_forked_run_killed_by_a_signal_exits_as_a_process_killed_by_it(tmp_path):
    r = trainapp("train", f"run.dir={tmp_path}", "train.max_steps=6", *QUICK, "drill.kill_at_step=2")
    assert r.returncode == -9, r.output[-2000:]


def test_once_the_tests_process_compiled_and_ran_backward_its_commands_start_fresh_and_train(tmp_path):
    """A process that compiled a model and ran its backward (as test_compile.py's in-process tests do in
    a lane) can no longer fork a child that trains: the child's backward fails. From then on the tests'
    commands start fresh interpreters (forked.usable), and the run trains. In a process of its own, so
    that the lane running this test keeps forking."""
    script = f"""
import sys
sys.path[:0] = [{str(REPO / "tests")!r}]
import torch, forked
from helpers import QUICK, trainapp
before = forked.usable()
torch.compile(torch.nn.Linear(4, 4), backend="eager")(torch.ones(2, 4)).sum().backward()
r = trainapp("train", "run.dir={tmp_path}", "train.max_steps=2", *QUICK)
print("usable", before, forked.usable(), "exit", r.returncode, r.stderr[-2000:])
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "usable True False exit 0" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])
    assert inspect(tmp_path)["global_step"] == 2


def test_a_forked_torchrun_keeps_its_temporary_directory_where_its_tmpdir_says(tmp_path):
    """The test's process chose its temporary directory before the suite set TMPDIR for its children, and
    `tempfile` keeps that choice: a forked torchrun would leave its torchelastic_* directory there (in
    /tmp, one per run) instead of where its own TMPDIR says, as a fresh one does."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = torchrun(1, f"run.dir={tmp_path / 'run'}", "train.max_steps=2", *QUICK, env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.output[-3000:]
    assert [p.name for p in tmp.iterdir() if p.name.startswith("torchelastic_")], list(tmp.iterdir())
