"""What runs in each Ray Train worker: the same rank (trainapp/launch/rank.py's `run_rank`) as under
torchrun, through the `RayWorker` launcher: the guard that the worker's set-up made before Ray
created the process group (`prepare_worker`, in trainapp/launch/ray/setup.py, which imports no
torch: Ray Train's controller and the driver reference it), the group Ray created, snapshots
published with `ray.train.report` (trainapp/launch/ray/publish.py), and Ray's drain notices. Only
the workers import this module (it imports torch), through setup.py's `train_worker` and
`comm_worker`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from trainapp import config
from trainapp.errors import leave
from trainapp.faults.guard import RankGuard
from trainapp.faults.preempt import Preempted
from trainapp.group import DistContext
from trainapp.launch import dist
from trainapp.launch.rank import run_rank
from trainapp.launch.ray.checks import is_uri
from trainapp.launch.ray.publish import RayDrainNotice, RayPublish
from trainapp.snapshots.lease import Fence, RunLease


class RayWorker:
    """`Launcher` (trainapp/launch/rank.py) for a Ray Train worker; `payload` is what the driver sent."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.payload = payload
        self._guard: RankGuard | None = None

    def guard(self, cfg: config.Config) -> RankGuard:
        guard = self._guard = RankGuard.installed() or RankGuard()  # made by prepare_worker, before the group
        for name, at in self.payload.get("launch", {}).items():  # the driver's start-up marks
            guard.timeline.mark(name, at)
        return guard

    def context(self, cfg: config.Config, guard: RankGuard) -> DistContext:
        return dist.setup(cfg.dist.timeout_s)  # adopts the group Ray created

    def publish(self, cfg: config.Config, ctx: DistContext) -> RayPublish:
        uri = cfg.ray.storage_path if is_uri(cfg.ray.storage_path) else None
        return RayPublish(Path(cfg.run.dir), uri, cfg.snapshot.async_, cfg.ray.name, cfg.ray.report_interval_s)

    def drains(self, cfg: config.Config) -> RayDrainNotice | None:
        return RayDrainNotice() if cfg.preempt.ray_poll_s else None

    def lease(self, cfg: config.Config, ctx: DistContext) -> RunLease:
        given = self.payload.get("lease") or {}  # the driver holds it: a retry of the group is the same run
        return RunLease(Fence.from_dict(given.get("fence")), given.get("summary"))

    def restart(self) -> int:
        return 0  # Ray Train's restarts show as attempts in metrics.jsonl

    def close(self, ctx: DistContext | None) -> None:
        # The worker process lives on after training (Ray stops a finished group with SIGTERM): from now on
        # a signal is no notice, it ends the process as it would without trainapp.
        if self._guard is not None:
            self._guard.training_over()
        if ctx is not None:
            dist.teardown(ctx)


def train_worker(payload: dict[str, Any]) -> None:
    """The per-worker function: the same rank as torchrun's, with snapshots published to Ray."""
    try:
        run_rank(RayWorker(payload), config.from_dict(payload["config"]), payload.get("task"))
    except Preempted as e:
        # The snapshot is reported; the process ends as under torchrun, and Ray Train restarts the group
        # from it (on the nodes that are left when a node is going away).
        if e.rank == 0:
            print(e.line(), file=sys.stderr, flush=True)
        leave(e.exit_code)


def comm_worker(payload: dict[str, Any]) -> dict[str, Any]:
    """`doctor --comm` under Ray: every worker measures the node pairs (trainapp/launch/comm.py) in the group
    Ray created; what rank 0 returns reaches the driver as `Result.return_value`."""
    from trainapp.launch import comm

    cfg = config.from_dict(payload["config"])
    ctx = dist.setup(cfg.dist.timeout_s)  # adopts the group Ray created, on the interface prepare_worker chose
    nodes, pairs = comm.measure(ctx, payload["nbytes"], payload["iters"])
    via = ctx.network.summary() if ctx.network else "the default interface"
    return {"comm_nodes": nodes, "comm_pairs": [dataclasses.asdict(p) for p in pairs], "comm_backend": ctx.backend,
            "comm_processes": ctx.world_size, "comm_via": via}
