"""The plain launcher: a process started alone, by torchrun (one node or many, `--max-restarts`), or by
Slurm through torchrun (slurm/train.sbatch). Ranks come from the environment, the process group is
created here, snapshots go to `run.dir/snapshots` on storage every rank sees, and signals are the only
notices.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainapp.config import Config
from trainapp.faults import drain
from trainapp.faults.guard import RankGuard
from trainapp.group import DistContext
from trainapp.launch import dist
from trainapp.launch.rank import Launcher
from trainapp.observe import logs
from trainapp.observe.live import LiveMetrics, serve
from trainapp.snapshots.lease import RunLease, take_for_group
from trainapp.snapshots.publish import LocalPublish


class Torchrun(Launcher):
    """`Launcher` (trainapp/launch/rank.py) for a process that torchrun, Slurm or a user started."""

    def __init__(self) -> None:
        self._entry: Path | None = None

    @property
    def name(self) -> str:
        if "SLURM_JOB_ID" in os.environ:
            return "slurm"
        return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "alone"

    def guard(self, cfg: Config) -> RankGuard:
        guard = RankGuard()
        guard.timeline.mark_process("worker_process")
        logs.setup_from_env()  # the network check logs before the group exists
        guard.install(cfg.preempt.signals, cfg.preempt.grace_s)
        self._entry = drain.register()  # `trainapp drain` finds this process
        return guard

    def context(self, cfg: Config, guard: RankGuard) -> DistContext:
        return dist.setup(cfg.dist, cfg.network)

    def publish(self, cfg: Config, ctx: DistContext) -> LocalPublish:
        return LocalPublish(Path(cfg.run.dir) / "snapshots", cfg.snapshot.keep)

    def lease(self, cfg: Config, ctx: DistContext) -> RunLease:
        kind = ("slurm" if os.environ.get("SLURM_JOB_ID")
                else "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "alone")
        return take_for_group(ctx, cfg.run.dir, kind, cfg.run.lease_s, cfg.run.take_over)

    def restart(self) -> int:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def live(self, cfg: Config, ctx: DistContext) -> LiveMetrics | None:
        return serve(cfg.observe.prometheus_port, Path(cfg.run.dir).name, ctx)

    def close(self, ctx: DistContext | None) -> None:
        if ctx is not None:
            dist.teardown(ctx)
        drain.unregister(self._entry)
