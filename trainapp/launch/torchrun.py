"""The plain launcher: a process started alone, by torchrun (one node or many, `--max-restarts`), or by
Slurm through torchrun (slurm/train.sbatch). Ranks come from the environment, the process group is
created here, snapshots go to `run.dir/snapshots` on storage every rank sees, and signals are the only
notices.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainapp.config import DistSection, NetworkSection, PreemptSection
from trainapp.faults import drain
from trainapp.faults.guard import RankGuard
from trainapp.group import DistContext
from trainapp.launch import dist
from trainapp.launch.rank import Launcher
from trainapp.observe import logs
from trainapp.startup import GcPause


class Torchrun(Launcher):
    """`Launcher` (trainapp/launch/rank.py) for a process that torchrun, Slurm or a user started; its run
    lives in `run.dir` on storage every rank sees (the default services). `gc_pause`: the collector paused
    by the entry point (trainapp/__main__.py), which the guard ends once the parts are built."""

    def __init__(self, gc_pause: GcPause | None = None) -> None:
        self._entry: Path | None = None
        self._gc_pause = gc_pause

    @property
    def name(self) -> str:
        if "SLURM_JOB_ID" in os.environ:
            return "slurm"
        return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "alone"

    def guard(self, preempt: PreemptSection) -> RankGuard:
        guard = RankGuard()
        guard.gc_pause = self._gc_pause
        guard.timeline.mark_process("worker_process")
        logs.setup_from_env()  # the network check logs before the group exists
        guard.install(preempt.signals, preempt.grace_s)
        self._entry = drain.register()  # `trainapp drain` finds this process
        return guard

    def context(self, dist_cfg: DistSection, network: NetworkSection, guard: RankGuard) -> DistContext:
        return dist.setup(dist_cfg, network)

    def restart(self) -> int:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def close(self, ctx: DistContext | None) -> None:
        if ctx is not None:
            dist.teardown(ctx)
        drain.unregister(self._entry)
