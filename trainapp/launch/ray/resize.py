"""A live resize of an elastic Ray run is a notice (docs/ray.md, "Elastic runs"): when Ray Train decides
to resize a running worker group (a node came back, or more room appeared), it would stop the group
at once and restart it from the last snapshot, redoing every step since. Instead the controller's
`ResizeSnapshot` callback (below) asks rank 0 of the running workers, through a file in the run's
lease folder, to stop at the next step with a snapshot; the workers agree on the step, snapshot it,
write a `resized` record and answer; then Ray Train replaces the group and the new one resumes from
that snapshot, at the same global sample and with the same global batch (trainapp/core/layout.py): no
step redone, the same math.

The workers use the request functions; the controller the callback (built on Ray Train's private
callback classes, through trainapp/launch/ray/private/callbacks.py).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from trainapp.launch.ray.private import say, versions
from trainapp.launch.ray.private.callbacks import ControllerCallback, WorkerGroupCallback
from trainapp.snapshots.lease import parse_record
from trainapp.snapshots.lease_store import ArrowStore, DirStore, store_at

if TYPE_CHECKING:
    from trainapp.launch.ray.private.callbacks import (
        FailureDecision,
        ResizeDecision,
        WorkerGroup,
        WorkerGroupContext,
        WorkerGroupPollStatus,
    )

REQUEST = "resize-request.json"
DONE = "resize-done.json"


def ask(store: DirStore | ArrowStore, was: int, to: int) -> str:
    """Ask the running workers to stop for a resize from `was` to `to` workers; the request's id."""
    rid = uuid.uuid4().hex[:12]
    store.replace(REQUEST,
                  json.dumps({"id": rid, "from": was, "to": to, "at": round(time.time(), 3)}).encode())
    return rid


def asked(store: DirStore | ArrowStore) -> dict[str, Any] | None:
    """The resize request standing now ({id, from, to, at}), or None."""
    return parse_record(store.read(REQUEST))


def answer(store: DirStore | ArrowStore, rid: str, step: int | None, snapshot: str | None) -> None:
    """Rank 0, once the snapshot of `step` is written (None: this attempt trained no step yet)."""
    store.replace(DONE, json.dumps({"id": rid, "step": step, "snapshot": snapshot,
                                    "at": round(time.time(), 3)}).encode())


def wait(store: DirStore | ArrowStore, rid: str, timeout_s: float,
         poll_s: float = 0.2) -> dict[str, Any] | None:
    """The answer to request `rid`, or None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = parse_record(store.read(DONE))
        if done and done.get("id") == rid:
            return done
        time.sleep(poll_s)
    return None


def clear(store: DirStore | ArrowStore, rid: str) -> None:
    """Withdraw request `rid` (answered or given up on): the next group must not act on it."""
    standing = asked(store)
    if standing and standing.get("id") == rid:
        store.delete(REQUEST)


class ResizeSnapshot(ControllerCallback, WorkerGroupCallback):
    """In Ray Train's controller, for elastic runs: before a running group of `was` workers is resized
    to `to`, ask its workers for a snapshot of the step reached and wait for it (at most `wait_s`), so
    the new group resumes from it. A group that is not running (a restart after a failure) has
    nothing to save: the callback does nothing then."""

    def __init__(self, run_dir: str, wait_s: float, check_s: float) -> None:
        self.run_dir, self.wait_s, self.check_s = run_dir, wait_s, check_s
        self._running = 0  # of the running, healthy group; 0 while none runs
        self._nodes, self._looked = 0, 0.0  # alive nodes when last looked, and when

    def after_worker_group_poll_status(self, worker_group_status: WorkerGroupPollStatus) -> None:
        """Every `check_s` while a group runs: when nodes joined the cluster, have the coordinator re-read
        it, so Ray Train's next resize check sees them (its view is otherwise up to 20 s old)."""
        now = time.monotonic()
        if not self._running or now - self._looked < self.check_s or not versions.cluster_reread():
            return
        self._looked = now
        try:
            import ray

            alive = sum(1 for n in ray.nodes() if n.get("Alive"))
            # Said once per join, not per check.
            grew, self._nodes = self._nodes and alive > self._nodes, alive
            if grew:
                versions.reread_cluster("trainapp-resize-snapshot")
        except Exception as e:  # information only: Ray Train's own view catches up by itself
            say(f"could not look for nodes that joined ({e.__class__.__name__}: {e})")

    def after_worker_group_start(self, worker_group: WorkerGroup) -> None:
        self._running = len(worker_group.get_workers())

    def before_worker_group_shutdown(self, worker_group: WorkerGroup) -> None:
        self._running = 0

    def before_worker_group_abort(self, worker_group_context: WorkerGroupContext) -> None:
        self._running = 0

    def before_controller_execute_failure_decision(self, failure_decision: FailureDecision) -> None:
        # The group failed: Ray Train shuts it down only when it executes the restart's resize, after
        # this callback's resize hook, and a failed group has no step to snapshot.
        self._running = 0

    def before_controller_execute_resize_decision(self, resize_decision: ResizeDecision) -> None:
        was, to = self._running, resize_decision.num_workers
        if not was or to == was:
            return
        try:  # an error raised here would fail the run: say it, and let Ray Train resize as it would
            self._snapshot(was, to)
        except Exception as e:
            say(f"resizing {was} -> {to} workers: could not ask the workers for a snapshot first "
                f"({e.__class__.__name__}: {e}); the new group resumes from the newest snapshot")

    def _snapshot(self, was: int, to: int) -> None:
        store, t0 = store_at(self.run_dir), time.monotonic()
        rid = ask(store, was, to)
        try:
            done = wait(store, rid, self.wait_s)
        finally:
            clear(store, rid)
        if done is None:
            say(f"resizing {was} -> {to} workers: no snapshot within {self.wait_s:.0f}s; the new group "
                "resumes from the newest snapshot")
        elif done["step"] is None:
            say(f"resizing {was} -> {to} workers: the group had trained no step yet")
        else:
            say(f"resizing {was} -> {to} workers: step {done['step']} snapshotted in "
                f"{time.monotonic() - t0:.1f}s; the new group resumes there")
