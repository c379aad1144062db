"""The trainer the driver fits: `TorchTrainer`, Ray's, made from its base class.

What Ray has no public way to do:

- Keep torch out of the job driver: Ray's `TorchTrainer` lives in a module that imports torch
  (seconds of CPU in the driver while the nodes' probes run). So `TorchTrainer` here is Ray's, made
  from its base class (`DataParallelTrainer`, a developer API), over backend.py's torch-free config.
- Leave out Ray Data for a run without Ray datasets: Ray Train starts a DatasetManager actor at every
  worker-group start whether there are datasets or not, and only its private default-callback list
  (`DataParallelTrainer._create_default_callbacks`) can drop it.
- Make the driver's first Ctrl-C a stop with a snapshot: Ray Train installs its SIGINT handler (abort
  the run) inside `fit()`, over any the driver installed before, through the private
  `DataParallelTrainer._register_sigint_handler`, which `on_sigint` extends.

Private names: `DatasetsCallback` (`ray.train.v2._internal.callbacks.datasets`), `DataParallelTrainer`
(`ray.train.v2.api.data_parallel_trainer`) and the two methods above (checked by their own tests).
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

from trainapp.launch.ray.private import unsupported
from trainapp.launch.ray.private.backend import TorchConfigWithSetup

PRIVATE_NAMES = (
    ("ray.train.v2._internal.callbacks.datasets", "DatasetsCallback"),
    ("ray.train.v2.api.data_parallel_trainer", "DataParallelTrainer"),
)
"""(module, name) of every private Ray name used here; tests/test_ray_compat.py imports each one."""

try:  # an import error here is a Ray version trainapp was not written for, said in one line
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
except ImportError as e:
    raise unsupported(e, __name__) from None

if TYPE_CHECKING:  # Ray's types in the hooks overridden here: private, so named here only
    from ray.actor import ActorHandle
    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2.api.callback import RayTrainCallback


class TorchTrainer(DataParallelTrainer):
    """Ray's TorchTrainer, made from its base class so that the driver imports no torch (Ray's
    TorchTrainer lives in a module that does: seconds of the driver's CPU on the start-up's critical
    path, while the nodes' probes want the same cores; docs/ray.md, "Start-up and recovery: where
    the seconds go"). Like Ray's, it chooses the backend (nccl with GPUs, else gloo) of its
    TorchConfigWithSetup and sets nothing else; Ray's local mode (no workers), which trainapp's
    `ray.num_workers` refuses, is left out.

    It also leaves out Ray Data's callback when the run has no Ray datasets (trainapp's never has:
    each rank builds its own shard). That callback starts a DatasetManager actor at every worker-group
    start, datasets or not: a fresh Python process that imports Ray Data and pandas, seconds of CPU
    beside the training workers' own imports at every start and restart. A run given datasets keeps it."""

    def __init__(self, train_loop_per_worker: Callable[[], Any] | Callable[[dict[str, Any]], Any], *,
                 torch_config: TorchConfigWithSetup | None = None, **kwargs: Any) -> None:
        torch_config = torch_config or TorchConfigWithSetup()
        if not torch_config.backend:
            scaling = kwargs.get("scaling_config")
            torch_config.backend = "nccl" if scaling is not None and scaling.use_gpu else "gloo"
        super().__init__(train_loop_per_worker, backend_config=torch_config, **kwargs)

    on_sigint: Callable[[], bool] | None = None
    """The driver's stop (trainapp/launch/ray/stop.py): called on Ctrl-C first; True when it handled it.
    Ray Train's own handler (abort the run, no snapshot) takes the next one."""

    def _create_default_callbacks(self) -> list[RayTrainCallback]:
        callbacks = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        return [cb for cb in callbacks if not isinstance(cb, DatasetsCallback)]

    def _register_sigint_handler(self, controller: ActorHandle[TrainController]) -> None:
        super()._register_sigint_handler(controller)  # Ray Train's: it aborts the controller
        if self.on_sigint is None:
            return
        ray_handler, first = signal.getsignal(signal.SIGINT), self.on_sigint
        assert callable(ray_handler)  # the Python function Ray Train has just installed

        def handler(signum: int, frame: FrameType | None) -> None:
            if not first():
                ray_handler(signum, frame)

        signal.signal(signal.SIGINT, handler)
