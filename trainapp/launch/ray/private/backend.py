"""Code on every Ray Train worker before the process group: `TorchConfigWithSetup`, Ray's TorchConfig
whose backend runs trainapp's setup (trainapp/launch/ray/setup.py's `prepare_worker`) first.

What Ray has no public way to do:

- Run code on every worker before Ray Train creates the process group: the network interface must be
  exported by then (trainapp/launch/net.py), or the group forms on the wrong interface or hangs. Only
  the backend of the backend config runs there, so `TorchConfigWithSetup` carries its own backend,
  which runs a setup function first. runtime_env's `worker_process_setup_hook` cannot replace it:
  Ray runs that hook only from a job-level runtime env, in every process of the job (the Train
  controller too, not just the training workers), and a hook that fails ends its process without the
  error reaching the driver.
- Keep torch out of Ray Train's controller: the controller unpickles the backend config and runs its
  backend, and Ray's `TorchConfig` and torch backend live in a module that imports torch (seconds of
  CPU at the controller's start, when nothing else can run yet). So the backend here is Ray's torch
  backend re-driven from this torch-free module: the same steps in the same order, each worker-side
  step Ray's own function, imported by name in the worker (`_in_worker`).

Private names: the worker-side steps of Ray's torch backend (`_setup_torch_process_group`,
`_set_torch_distributed_env_vars`, `_shutdown_torch`, `TorchConfigContextManager` in
`ray.train.torch.config`), `get_address_and_port` (`ray.train._internal.utils`) and `TrainingFramework`
(`ray.train.v2._internal.util`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import TYPE_CHECKING, Any, Callable

from trainapp.launch.ray.private import say, unsupported

PRIVATE_NAMES = (
    ("ray.train.torch.config", "_setup_torch_process_group"),
    ("ray.train.torch.config", "_set_torch_distributed_env_vars"),
    ("ray.train.torch.config", "_shutdown_torch"),
    ("ray.train.torch.config", "TorchConfigContextManager"),
    ("ray.train._internal.utils", "get_address_and_port"),
    ("ray.train.v2._internal.util", "TrainingFramework"),
)
"""(module, name) of every private Ray name used here; tests/test_ray_compat.py imports each one."""

try:  # an import error here is a Ray version trainapp was not written for, said in one line
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.train.backend import Backend, BackendConfig
    from ray.train.constants import (
        DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    )
    from ray.train.v2._internal.util import TrainingFramework
except ImportError as e:
    raise unsupported(e, __name__) from None

if TYPE_CHECKING:  # Ray's types in the hooks overridden here: private, so named here only
    from ray.train._internal.base_worker_group import BaseWorkerGroup
    from ray.train.torch.config import TorchConfigContextManager


_TORCH_CONFIG = "ray.train.torch.config"  # Ray's torch backend: imports torch


def _in_worker(module: str, name: str, env: dict[str, str] | None = None, **kwargs: Any) -> Any:
    """In a worker: set `env`, then call Ray's `module.name(**kwargs)`, imported here, where torch is
    wanted, rather than pickled by reference from the controller, which would import it there."""
    os.environ.update(env or {})
    return getattr(importlib.import_module(module), name)(**kwargs)


class _TorchBackendWithSetup(Backend):
    """Ray's torch backend (`ray.train.torch.config._TorchBackend.on_start`/`on_shutdown`) for the
    init method "env" and a backend TorchTrainer has chosen (gloo, or nccl with GPUs), with the
    config's setup run on every worker first."""

    share_cuda_visible_devices = True  # as Ray's: each worker sees its node's GPUs

    # Ray calls a backend with the config whose `backend_cls` it is; Ray's own backends narrow it too.
    def on_start(self, worker_group: BaseWorkerGroup,  # type: ignore[override]
                 backend_config: TorchConfigWithSetup) -> None:
        if backend_config.setup is not None:
            worker_group.execute(backend_config.setup, **backend_config.setup_kwargs)
        addr, port = worker_group.execute_single(0, _in_worker, "ray.train._internal.utils",
                                                 "get_address_and_port")
        worker_group.execute(_in_worker, _TORCH_CONFIG, "_set_torch_distributed_env_vars",
                             env={"MASTER_ADDR": addr, "MASTER_PORT": str(port)})
        # Ray's worker group returns ray.types.ObjectRef, which Ray's ray.get is not annotated to take.
        ray.get([worker_group.execute_single_async(i, _in_worker, _TORCH_CONFIG, "_setup_torch_process_group",
                                                   backend=backend_config.backend, world_rank=i,
                                                   world_size=len(worker_group), init_method="env://",
                                                   timeout_s=backend_config.timeout_s)
                 for i in range(len(worker_group))])  # type: ignore[arg-type]

    def on_shutdown(self, worker_group: BaseWorkerGroup,  # type: ignore[override]  # as on_start
                    backend_config: TorchConfigWithSetup) -> None:
        futures = worker_group.execute_async(_in_worker, _TORCH_CONFIG, "_shutdown_torch",
                                             destroy_process_group=len(worker_group) > 1)
        timeout_s = float(os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                         DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))
        try:
            ray.get(futures, timeout=timeout_s)  # type: ignore[arg-type]  # as in on_start
        except GetTimeoutError:
            say(f"the torch process group did not shut down within {timeout_s:g}s")


class _TorchContext:
    """Ray's TorchConfigContextManager (around the training function, in each worker), imported only
    in the worker: the driver builds the trainer, and its module imports torch."""

    _inner: TorchConfigContextManager

    def __enter__(self) -> None:
        from ray.train.torch.config import TorchConfigContextManager

        self._inner = TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc: object) -> bool:
        return self._inner.__exit__(*exc)


@dataclasses.dataclass
class TorchConfigWithSetup(BackendConfig):
    """Ray's TorchConfig (same fields and defaults, init method "env" only) whose backend first runs
    `setup(**setup_kwargs)` on every worker, before it creates the process group, and which imports
    no torch where the controller unpickles it. An exception in `setup` ends the run as a
    ControllerError whose `controller_failure` carries it."""

    backend: str | None = None
    """The process group's backend; Ray's TorchTrainer sets it (nccl with GPUs, else gloo)."""
    timeout_s: int = 1800
    """Seconds for process-group operations to time out."""
    setup: Callable[..., Any] | None = None
    """Runs on every worker before the process group exists; must live in a module without torch."""
    setup_kwargs: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments of `setup`."""

    @property
    def backend_cls(self) -> type[_TorchBackendWithSetup]:
        return _TorchBackendWithSetup

    @property
    def train_func_context(self) -> type[_TorchContext]:
        return _TorchContext

    @property
    def framework(self) -> TrainingFramework:
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}
