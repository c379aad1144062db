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
import hashlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainapp import config
from trainapp.errors import leave
from trainapp.faults.guard import RankGuard
from trainapp.faults.preempt import Notices, Preempted, Resized, Stopped, StoppedBeforeStart
from trainapp.group import DistContext
from trainapp.launch import dist
from trainapp.launch.rank import Launcher, Services, run_rank
from trainapp.launch.ray import metrics as ray_metrics
from trainapp.launch.ray import node_memory, resize, spares
from trainapp.launch.ray.checks import is_uri
from trainapp.launch.ray.private import versions
from trainapp.launch.ray.publish import RayDrainNotice, RayPublish
from trainapp.observe.live import LiveMetrics
from trainapp.snapshots.lease import Fence, RunLease, stop_request
from trainapp.snapshots.lease_store import ArrowStore, DirStore, store_at

if TYPE_CHECKING:
    import torch

REPLACED_WITHIN_S = 120.0
"""How long workers that snapshotted for a resize wait for Ray Train to replace their group."""
PEAK_EVERY_S = 1.0
"""How often the node's memory is sampled before its spares are asked for (its peak decides how many)."""


def _ray_device() -> torch.device:
    """The device Ray Train gave this worker: the first of the GPUs it reserved (it set
    CUDA_VISIBLE_DEVICES for them), or the CPU."""
    from ray.train.torch import get_device

    return get_device()


class RayWorker(Launcher):
    """`Launcher` (trainapp/launch/rank.py) for a Ray Train worker: the guard `prepare_worker` made, the
    group Ray created; its services are Ray's (`RayServices`). `payload` is what the driver sent, `ray`
    its config's `ray` section."""

    name = "ray"
    services: RayServices

    def __init__(self, payload: dict[str, Any], ray: config.RaySection) -> None:
        self.services = RayServices(payload, ray)
        self._guard: RankGuard | None = None

    def guard(self, preempt: config.PreemptSection) -> RankGuard:
        guard = self._guard = RankGuard.installed() or RankGuard()  # made by prepare_worker, before the group
        for name, at in self.services.payload.get("launch", {}).items():  # the driver's start-up marks
            guard.timeline.mark(name, at)
        return guard

    def context(self, dist_cfg: config.DistSection, network: config.NetworkSection,
                guard: RankGuard) -> DistContext:
        return dist.setup(dist_cfg, ray_device=_ray_device)  # adopts the group Ray created

    def close(self, ctx: DistContext | None) -> None:
        # The worker process lives on after training (Ray stops a finished group with SIGTERM): from now on
        # a signal is no notice, it ends the process as it would without trainapp.
        self.services.stop_watching()
        if self._guard is not None:
            self._guard.training_over()
        if ctx is not None:
            dist.teardown(ctx)

    def resized(self, step: int | None, snapshot: str | None) -> None:
        """Rank 0, after the snapshot a resize asked for: the answer to the controller's request."""
        self.services.resized(step, snapshot)


class RayServices(Services):
    """The run's services under Ray Train: the driver holds the lease (a retry of the group is the same
    run), snapshots are published with `ray.train.report` (to `ray.storage_path`), Ray's node drains are
    notices, live metrics go to Ray's metrics agent. `payload`: what the driver sent (the lease, the resize
    folder); `ray`: the run's `ray` section."""

    def __init__(self, payload: dict[str, Any], ray: config.RaySection) -> None:
        self.payload, self.ray = payload, ray
        self._watch: StopWatch | None = None

    def lease(self, ctx: DistContext, run: config.RunSection, kind: str) -> RunLease:
        given = self.payload.get("lease") or {}  # the driver holds it: a retry of the group is the same run
        held = RunLease(Fence.from_dict(given.get("fence")), given.get("summary"))
        # A stop asked for before this attempt started (during a restart of the group): every rank ends.
        asked = ctx.files.broadcast_object(stop_request(held.fence) if ctx.rank == 0 else None)
        if asked:
            raise StoppedBeforeStart(f"trainapp: stopped ({asked['by']}) before this attempt trained a step; "
                                     "the newest snapshot is where the run resumes")
        return held

    def watch(self, ctx: DistContext, held: RunLease, guard: RankGuard) -> None:
        """Rank 0 watches the lease for a stop (`ray job stop`) and, in an elastic group, the driver's
        resize controller's folder (the payload's `resizes`) for a resize; the others hear of either
        through the stop vote."""
        if ctx.rank == 0:
            folder = self.payload.get("resizes")  # only an elastic group is resized live
            self._watch = StopWatch(held.fence, store_at(folder) if folder else None, guard.notices)

    def publish(self, ctx: DistContext, run_dir: str, snapshot: config.SnapshotSection) -> RayPublish:
        uri = self.ray.storage_path if is_uri(self.ray.storage_path) else None
        return RayPublish(Path(run_dir), uri, snapshot.async_, self.ray.name, self.ray.report_interval_s)

    def memory_id(self, held: RunLease) -> str | None:
        """With `ray.storage_path` a URI, `run.dir` is each node's own: a rank 0 on another node after a
        lost node would not find the id there, and the survivors' copies in memory would be another run's.
        The id is then the lease's (its URI and generation: one per submission), the same on every node."""
        fence = held.fence
        if not is_uri(self.ray.storage_path) or not fence.generation:
            return None
        return hashlib.blake2b(f"{fence.run_dir}#{fence.generation}".encode(), digest_size=8).hexdigest()

    def drains(self, preempt: config.PreemptSection) -> RayDrainNotice | None:
        return RayDrainNotice() if preempt.ray_poll_s and versions.drain_notices() else None

    def live(self, ctx: DistContext, observe: config.ObserveSection, run_dir: str) -> LiveMetrics | None:
        return ray_metrics.live(observe.ray_metrics, ctx, self.ray.name)

    def resized(self, step: int | None, snapshot: str | None) -> None:
        watch = self._watch
        assert watch is not None and watch.store is not None and watch.resize_id is not None  # its request
        resize.answer(watch.store, watch.resize_id, step, snapshot)

    def stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.stop.set()


class StopWatch:
    """Rank 0's watch on the requests the workers cannot hear as a signal, read every `poll_s`: the
    driver's stop in the lease's record (`ray job stop` signals the driver), and the controller's resize
    in `store` (trainapp/launch/ray/resize.py). A request becomes this rank's notice, which the stop
    vote carries to every rank at the next step boundary."""

    def __init__(self, fence: Fence, store: DirStore | ArrowStore | None, notices: Notices,
                 poll_s: float = 0.5) -> None:
        """`store`: where the resize requests come (the run's lease folder), None where none can (a group
        of a fixed size)."""
        self.fence, self.store, self.notices, self.poll_s = fence, store, notices, poll_s
        self.started = time.time()
        self.resize_id: str | None = None
        """The resize request this attempt stops for, once it is a notice."""
        self._answered: set[str] = set()  # requests answered without a snapshot: once each
        self.stop = threading.Event()
        threading.Thread(target=self._run, name="stop-watch", daemon=True).start()

    def _run(self) -> None:
        while not self.stop.wait(self.poll_s):
            try:
                asked = stop_request(self.fence)
                resizing = resize.asked(self.store) if self.store is not None else None
            except OSError:  # storage that does not answer now: the next poll asks again
                continue
            if asked:
                self.notices.request(int(signal.Signals[asked["signal"]]), asked["by"])
                return
            if resizing and self._resize(resizing):
                return

    def _resize(self, req: dict[str, Any]) -> bool:
        """Act on the resize request `req`: True once it is this rank's notice. One made before this
        watch started, or before this attempt's first step, is answered at once: nothing trained here
        is lost when the group is replaced (and a request left by a controller that died is harmless)."""
        if req["id"] in self._answered:
            return False
        if req["at"] < self.started or self.notices.heartbeat.phase == "start":
            assert self.store is not None  # where `req` was read
            resize.answer(self.store, req["id"], None, None)
            self._answered.add(req["id"])
            return False
        self.resize_id = req["id"]
        self.notices.request(signal.SIGTERM, f"resize from {req['from']} to {req['to']} workers",
                             kind="resize")
        return True


def keep_spares(after_s: float) -> threading.Event:
    """After `after_s` seconds (unless the returned event is set first), the node's first worker brings the
    node's idle spare processes up to one per training worker there, as many as the node's memory has room
    for at its peak over those seconds, sampled every `PEAK_EVERY_S` (trainapp/launch/ray/spares.py).
    Nothing happens where the driver gave the workers nothing to preload (`ray.spare_workers=false`, a job
    with a setup hook of its own)."""
    done = threading.Event()

    def run() -> None:
        peak, end = node_memory.read(), time.monotonic() + after_s
        while (left := end - time.monotonic()) > 0:
            if done.wait(min(PEAK_EVERY_S, left)):
                return
            now = node_memory.read()
            peak = now if now.used > peak.used else peak
        if done.is_set():
            return
        try:
            import ray.train

            ctx = ray.train.get_context()
            if ctx.get_local_rank() == 0:
                spares.top_up(ctx.get_local_world_size(), spares.KEEP_S, peak)
        except Exception as e:  # the run trains on; a restart then starts fresh processes, as without spares
            print(f"trainapp: ray.spare_workers: no spare processes on this node ({type(e).__name__}: {e})",
                  file=sys.stderr, flush=True)

    if os.environ.get(spares.PRELOAD):
        threading.Thread(target=run, name="trainapp-spares", daemon=True).start()
    return done


def train_worker(payload: dict[str, Any]) -> None:
    """The per-worker function: the same rank as torchrun's, with snapshots published to Ray."""
    cfg = config.from_dict(payload["config"])
    worker = RayWorker(payload, cfg.ray)
    spared = keep_spares(cfg.ray.spare_after_s)
    try:
        run_rank(worker, cfg, payload.get("task"))
    except Resized as e:  # the snapshot is written: say so to the controller, and wait to be replaced
        if e.rank == 0:
            worker.resized(e.step, e.snapshot)
            print(e.line(), file=sys.stderr, flush=True)
        time.sleep(REPLACED_WITHIN_S)
        leave(e.exit_code)  # never replaced: end as a preempted worker, and Ray Train restarts the group
    except Stopped as e:  # the driver was told to stop: the run ends here, a normal end to Ray Train
        if e.rank == 0:
            print(e.line(), file=sys.stderr, flush=True)
    except StoppedBeforeStart as e:
        print(e, file=sys.stderr, flush=True)
    except Preempted as e:
        # The snapshot is reported; the process ends as under torchrun, and Ray Train restarts the group
        # from it (on the nodes that are left when a node is going away).
        if e.rank == 0:
            print(e.line(), file=sys.stderr, flush=True)
        leave(e.exit_code)
    finally:
        spared.set()


def comm_worker(payload: dict[str, Any]) -> dict[str, Any]:
    """`doctor --comm` under Ray: every worker measures the node pairs (trainapp/launch/comm.py) in the group
    Ray created; what rank 0 returns reaches the driver as `Result.return_value`."""
    from trainapp.launch import comm

    cfg = config.from_dict(payload["config"])
    # Adopts the group Ray created, on the interface prepare_worker chose.
    ctx = dist.setup(cfg.dist, ray_device=_ray_device)
    nodes, pairs = comm.measure(ctx, payload["nbytes"], payload["iters"])
    via = ctx.network.summary() if ctx.network else "the default interface"
    return {"comm_nodes": nodes, "comm_pairs": [dataclasses.asdict(p) for p in pairs],
            "comm_backend": ctx.backend, "comm_processes": ctx.world_size, "comm_via": via}
