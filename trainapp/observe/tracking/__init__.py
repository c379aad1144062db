"""Experiment tracking: rank 0 hands the run to MLflow (`observe.mlflow_uri`) and Weights & Biases
(`observe.wandb_project`), one tracker run per run directory across every restart, one value per step:
the one the final model descends from (docs/observability.md#experiment-tracking).

Values reach a tracker once a snapshot covering their step is published (no later attempt can train
that step again), or when the run ends; the live curves stay with Prometheus and TensorBoard. Both
trackers are optional extras, imported only when set.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

from trainapp.config import ConfigError, ObserveSection
from trainapp.observe.tracking.sender import STOP_WAIT_S, Sender

__all__ = ["STOP_WAIT_S", "Sender", "check", "senders"]


def check(o: ObserveSection) -> None:
    """Every rank, before training: each tracker set in `o` (the `observe` section) has its package, or one
    line saying how to get it."""
    for key, value, package in (("observe.mlflow_uri", o.mlflow_uri, "mlflow"),
                                ("observe.wandb_project", o.wandb_project, "wandb")):
        if value and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{key}={value!r} needs the {package} package: pip install "
                              f"'trainapp[{package}]' (or set {key}='')")


def senders(o: ObserveSection, run_dir: Path, launcher: str,
            fence: Callable[[str], None] | None = None) -> list[Sender]:
    """Rank 0: a sender per tracker set in `o` (the `observe` section, not started), for the run in
    `run_dir` (`run.dir`; `trainapp track` names the directory it reads, wherever the run had it)."""
    out = []
    if o.mlflow_uri:
        from trainapp.observe.tracking.mlflow_sink import MlflowSink

        out.append(Sender(MlflowSink(o.mlflow_uri, o.mlflow_experiment, run_dir.resolve().name), run_dir,
                          launcher, fence))
    if o.wandb_project:
        from trainapp.observe.tracking.wandb_sink import WandbSink

        out.append(Sender(WandbSink(o.wandb_project, run_dir, run_dir.resolve().name), run_dir, launcher,
                          fence))
    return out
