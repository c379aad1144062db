"""The benchmarks keep working: each runs in its tiny smoke mode (numbers are not asserted)."""

import json
import sys

import pytest

from helpers import REPO, run_cmd

pytestmark = pytest.mark.slow


def test_loop_overhead_benchmark_smoke(tmp_path):
    out = tmp_path / "loop_overhead.json"
    r = run_cmd([sys.executable, str(REPO / "bench" / "loop_overhead.py"), "--smoke", "--out", str(out)], timeout=300)
    assert r.returncode == 0, r.output
    result = json.loads(out.read_text())
    assert result["smoke"] is True and result["world_size"] == 2
    assert result["loop_overhead_ratio"] > 0 and result["control_ratio"] > 0
    assert len(result["trainapp_step_ms_rounds"]) == len(result["minimal_step_ms_rounds"]) == 1
    assert "loop_overhead_ratio=" in r.stdout


def test_launchers_benchmark_smoke(tmp_path):
    out = tmp_path / "launchers.json"
    r = run_cmd([sys.executable, str(REPO / "bench" / "launchers.py"), "--smoke", "--out", str(out)], timeout=600)
    assert r.returncode == 0, r.output[-4000:]
    result = json.loads(out.read_text())
    assert result["smoke"] is True
    assert result["startup_seconds_ray"] > 0 and result["startup_seconds_torchrun"] > 0
    assert result["ray_vs_torchrun_step_ratio"] > 0
