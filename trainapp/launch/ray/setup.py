"""The torch-free entry points of a Ray Train worker: what it runs before Ray creates the process
group (`prepare_worker`: the worker's environment, thread count, signal handlers and network
interface), and the per-worker functions the driver hands Ray (`train_worker`, `comm_worker`, which
call trainapp/launch/ray/worker.py's in the worker).

This module imports no torch (only its functions do, in the worker): Ray Train's controller holds a
reference to `prepare_worker` in the backend config it is handed (trainapp/launch/ray/private/backend.py),
and the driver pickles references to the per-worker functions; unpickling or taking a reference
imports this module there. Neither the controller nor the driver trains, and a torch import is seconds of
CPU on the start-up's critical path (docs/ray.md, "Start-up and recovery: where the seconds go").
"""

from __future__ import annotations

import importlib
import os
import threading
from types import MappingProxyType, ModuleType
from typing import Any, Callable

from trainapp import config


def _import(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # the worker function's own import, after this, says what is wrong
            return


def prepare_worker(env: dict[str, str], threads: int, network: dict[str, Any], preemption: dict[str, Any],
                   imports: list[str]) -> str:
    """Runs in every worker before Ray creates the process group, in the worker's main thread (where
    Python takes signals: the loop runs in a thread of Ray's); returns its network choice. It makes the
    rank's guard (trainapp/faults/guard.py), which the training function finds again. `imports`: the
    worker function's (IMPORTS), started in a thread the guard keeps, as this returns. The cyclic
    collector is paused from here until the rank's parts are built (trainapp/startup.py)."""
    from trainapp.startup import GcPause

    pause = GcPause()
    import torch

    from trainapp.faults import drain
    from trainapp.faults.guard import RankGuard
    from trainapp.launch import net
    from trainapp.launch.ray import spares
    from trainapp.launch.ray.private import report_lines

    guard = RankGuard()
    guard.gc_pause = pause
    guard.timeline.mark_process("worker_process")
    preloaded = spares.taken()
    if preloaded is not None:  # this process waited as a spare, its imports done
        guard.timeline.mark("worker_preloaded", preloaded)
    guard.timeline.mark("worker_setup")
    report_lines.quiet_report_lines()  # Ray Train has configured the worker's logging by now
    # Ray's own SIGTERM handler ends the worker at once; ours turns it into the agreed stop.
    guard.install(preemption["signals"], preemption["grace_s"])
    drain.register()  # `trainapp drain` finds this worker; the entry goes stale with the process
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    summary = net.apply(config.NetworkSection(**network), net.ray_head_host()).summary()
    # Ray forms the process group next, a few round trips through its controller in which the worker
    # mostly waits: the worker function's imports go in that time, in a thread it joins first.
    guard.before_training = threading.Thread(target=_import, args=(imports,), name="trainapp-imports",
                                             daemon=True)
    guard.before_training.start()
    guard.timeline.mark("worker_setup_done")
    return summary


def _ray_worker() -> ModuleType:
    """trainapp/launch/ray/worker.py, once the imports `prepare_worker` started are done (no two
    threads import the same modules at once)."""
    from trainapp.faults.guard import RankGuard

    guard = RankGuard.installed()
    if guard is not None:
        guard.timeline.mark("process_group")  # Ray formed it before calling the worker function
        if guard.before_training is not None:
            guard.before_training.join()
    from trainapp.launch.ray import worker

    return worker


def train_worker(payload: dict[str, Any]) -> None:
    _ray_worker().train_worker(payload)


def comm_worker(payload: dict[str, Any]) -> dict[str, Any]:
    return _ray_worker().comm_worker(payload)


IMPORTS: MappingProxyType[Callable[[dict[str, Any]], Any], tuple[str, ...]] = MappingProxyType({
    # torch._dynamo: DistributedDataParallel and torch.optim import it on first use, seconds of CPU.
    train_worker: ("torch._dynamo", "trainapp.launch.rank", "trainapp.launch.ray.worker"),
    comm_worker: ("trainapp.launch.comm", "trainapp.launch.ray.worker"),
})
"""The modules each worker function imports first: `prepare_worker` imports them while the group forms."""

PRELOADS: MappingProxyType[Callable[[dict[str, Any]], Any], tuple[str, ...]] = MappingProxyType({
    train_worker: ("torch", "ray.train", "ray.train.torch.config", __name__, *IMPORTS[train_worker]),
})
"""What a spare worker process imports before it is needed (trainapp/launch/ray/spares.py): a training
worker's imports, Ray Train's and its torch backend's among them."""
