"""trainapp from Python, for users who start runs from a script of their own (as Ray Train users
write a `train_func`): the same run as the command line, of a task object the script made.

    import trainapp
    trainapp.main(MyTask(hidden=64))          # `python train.py train.max_steps=500` under any launcher
    summary = trainapp.fit(MyTask(), overrides=["train.max_steps=500"])   # returns; raises on failure
    summary = trainapp.fit_ray(MyTask(), overrides=["ray.num_workers=4"])  # the Ray driver
    model = trainapp.load_model("runs/r/model")  # the trained model back, from its export (docs/export.md)

`fit` runs one rank under the launcher the process finds itself in: alone, torchrun (one process
per rank runs the script), or Slurm's torchrun (slurm/train.sbatch). `fit_ray` is the driver of
`python -m trainapp ray`: Ray Train starts the workers and ships them the task object.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NoReturn

from trainapp.errors import leave
from trainapp.tasks.load import configure

if TYPE_CHECKING:
    import torch


def fit(task: Any = None, config: str | Path | Mapping | None = None, overrides: Iterable[str] = ()) -> dict:
    """Train `task` (default: the one `task.name` names) as one rank under the launcher this process
    finds itself in; this rank's summary. Raises trainapp's failures (`trainapp.errors.Failure`: each
    has its `exit_code`) and `Preempted` after a handled notice."""
    cfg, task = configure(config, list(overrides), task)
    from trainapp.launch.rank import run_rank
    from trainapp.launch.torchrun import Torchrun

    return run_rank(Torchrun(), cfg, task)


def fit_ray(task: Any = None, config: str | Path | Mapping | None = None,
            overrides: Iterable[str] = ()) -> dict:
    """Drive a Ray Train run of `task` on the Ray cluster `ray.address` names (or the one this
    process runs in); rank 0's last report and `storage`. The task object travels to the workers
    pickled (cloudpickle): its class must be importable there or defined in the script itself."""
    cfg, task = configure(config, list(overrides), task)
    from trainapp.launch.ray import driver

    return driver.run(cfg, task)


def load_model(path: str | Path, task: Any = None) -> torch.nn.Module:
    """The task's `torch.nn.Module` with the weights at `path` (an export directory, its `model.safetensors`,
    a run directory or a snapshot), in eval mode on the CPU; `task`: the task object to build the model
    with (default: the one the run's config names, which must import here)."""
    from trainapp.tools.export import load_model as load

    return load(path, task)


def main(task: Any = None, argv: list[str] | None = None, command: str = "train") -> NoReturn:
    """The command line on `task`: `trainapp train` (or `ray`) with `argv` (default: the script's
    arguments, `--config FILE` and `KEY=VALUE` overrides): the same one-line errors, done line and exit
    codes as `python -m trainapp`."""
    from trainapp import cli

    code = cli.main([command, *(sys.argv[1:] if argv is None else argv)], task=task)
    if command == "train":
        leave(code)  # as `python -m trainapp train` (trainapp.errors.leave says why)
    sys.exit(code)
