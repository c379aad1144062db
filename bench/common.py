"""What several benchmarks share: where the repository and its results are, the benchmark run's
overrides, the command that launches it under torchrun or Ray, and the readers of its records."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from devtools.local_ray import LocalCluster

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BIN = Path(sys.executable).parent

# The processes a benchmark starts (Ray's workers, torchrun's, `python -m bench.NAME --child`) do not
# start in this checkout: make them import its trainapp and bench (a worktree's, say), not whichever
# trainapp the venv's editable install points at.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


def result_path(name: str, smoke: bool, out: str | None = None) -> Path:
    """Where a benchmark writes its result: `--out`, else bench/results/NAME (results/smoke/NAME for a
    smoke run, so a smoke run never overwrites a measured result)."""
    return Path(out) if out else HERE / "results" / ("smoke" if smoke else "") / name


def write_result(out: Path, result: dict) -> None:
    """A benchmark's result as indented JSON at `out` (its folder made)."""
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


MEMORY_TIER_KEYS = ("memory_recovery_seconds", "memory_recovery_seconds_torchrun", "storage_recovery_seconds",
                    "storage_recovery_seconds_torchrun", "memory_over_storage_loss",
                    "memory_over_storage_loss_torchrun", "memory_tier_measured")
"""bench/memory.py's time per failure, kept in bench/results/launchers.json beside the launchers' own
recovery times (where issue 69 asked for them); `memory_tier_measured` says when, where and from which
file. bench/launchers.py keeps them when it writes that file again."""


def memory_tier_keys(result: dict, source: Path) -> dict:
    """The MEMORY_TIER_KEYS of bench/memory.py's `result` (written to `source`)."""
    keys = {k: result[k] for k in MEMORY_TIER_KEYS if k in result}
    keys["memory_tier_measured"] = {"by": "bench/memory.py", "file": source.name, "date": result.get("date"),
                                    "machine": result.get("machine")}
    return keys


def kept_memory_tier_keys(out: Path) -> dict:
    """The MEMORY_TIER_KEYS already in the launchers' result `out` (none when it is not there)."""
    import json

    try:
        old = json.loads(out.read_text())
    except (OSError, ValueError):
        return {}
    return {k: old[k] for k in MEMORY_TIER_KEYS if k in old}


def overrides(steps: int, snapshot_every: int, *extra: str) -> list[str]:
    """The benchmarks' run: the built-in model on 2048 synthetic images, `steps` steps."""
    return [f"train.max_steps={steps}", "train.epochs=100", f"snapshot.every_steps={snapshot_every}",
            "train.progress=false", "data.train_size=2048", "data.val_size=256", *extra]


def launch_cmd(launcher: str, run_dir: Path, args: list[str], cluster: LocalCluster | None,
               max_failures: int, workers: int = 2) -> tuple[list[str], dict[str, str]]:
    """(command, environment) running trainapp with `args` under torchrun (`workers` processes of one
    thread, one restart) or as a `workers`-worker `ray job submit` to `cluster` (one CPU, so one
    thread, each) with `ray.max_failures`."""
    if launcher == "torchrun":
        return ([str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={workers}", "--max-restarts=1",
                 "-m", "trainapp", "train", f"run.dir={run_dir}", *args],
                {**os.environ, "OMP_NUM_THREADS": "1"})
    return ([str(BIN / "ray"), "job", "submit", "--address", cluster.dashboard_url, "--", "python", "-m",
             "trainapp", "ray", f"ray.storage_path={run_dir.parent}", f"ray.name={run_dir.name}",
             f"ray.max_failures={max_failures}", f"ray.num_workers={workers}", *args], cluster.env())


def records(run_dir: Path) -> list[dict]:
    # Imported here: bench/export.py's measured child imports bench.common and must not load trainapp.
    from trainapp.observe import metrics

    return metrics.read(run_dir, missing_ok=True)


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if r["kind"] == "train"]


def wait_for(pred: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def first_step_start(recs: list[dict]) -> float:
    """Wall-clock time the first optimizer step began: the first record's time less its interval."""
    start = next(r for r in recs if r["kind"] == "start")
    first = next(r for r in recs if r["kind"] == "train")
    return first["time"] - (first["step"] - start["step"]) * start["global_batch"] / first["samples_per_s"]


def first_step_after_restart(run_dir: Path) -> float | None:
    seen_start = 0
    for r in records(run_dir):
        if r["kind"] == "start":
            seen_start += 1
        elif r["kind"] == "train" and seen_start >= 2:
            return r["time"]
    return None
