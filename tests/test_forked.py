"""The tests' forked `python -m trainapp` (tests/forked.py) behaves as a fresh interpreter would: the
same lines and parameters, the same errors for what only the test's own process could import, the
same exit code for a process killed by a signal."""

from __future__ import annotations

import re

import pytest
from helpers import QUICK, inspect, one_error_line, trainapp

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
