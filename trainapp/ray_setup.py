"""What each Ray Train worker runs before Ray creates the process group (`prepare_worker`): the
worker's environment, thread count, signal handlers and network interface.

This module imports no torch (it imports it only when `prepare_worker` runs, in the worker): Ray
Train's controller holds a reference to `prepare_worker` in the backend config it is handed
(trainapp/ray_compat.py), and unpickling that reference imports this module there. The controller
never trains, and a torch import is seconds of CPU on the start-up's critical path (docs/ray.md,
"Start-up and recovery: where the seconds go").
"""

from __future__ import annotations

import os
from typing import Any

from trainapp import config, timeline


def prepare_worker(env: dict[str, str], threads: int, network: dict[str, Any], preemption: dict[str, Any]) -> str:
    """Runs in every worker before Ray creates the process group, in the worker's main thread (where
    Python takes signals: the loop runs in a thread of Ray's); returns its network choice."""
    timeline.mark_process("worker_process")
    timeline.mark("worker_setup")
    import torch

    from trainapp import net, preempt

    # Ray's own SIGTERM handler ends the worker at once; ours turns it into the agreed stop.
    preempt.install(preemption["signals"], preemption["grace_s"])
    preempt.register()  # `trainapp drain` finds this worker; the entry goes stale with the process
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    summary = net.apply(config.NetworkSection(**network), net.ray_head_host()).summary()
    timeline.mark("worker_setup_done")  # Ray creates the process group next
    return summary
