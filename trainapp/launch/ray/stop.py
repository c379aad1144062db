"""A stop of a Ray run is a notice (docs/ray.md, "Stopping a run"): `ray job stop` (also from a Ray head pod's
preStop, `trainapp stop-jobs`) and Ctrl-C of a driver in the foreground reach only the driver, as a signal.
The driver asks the workers through the run's lease (trainapp/snapshots/lease.py): its record says
`stop`, rank 0 of the workers reads it within half a second (trainapp/launch/ray/worker.py's
`StopWatch`), and the workers agree on a step, snapshot it, register it with Ray, write a `stopped`
record and end normally, so Ray Train ends the run (and cancels its resource request) instead of
restarting it.

`ray job stop` kills the job `RAY_JOB_STOP_WAIT_TIME_S` after its signal (Ray's default: 3 s), read from
the job's runtime environment: `make ray-submit` and the KubeRay `RayJob` set it to `STOP_WAIT_S` (a
deleted or suspended `RayJob` is no job stop: KubeRay terminates its pods; the head pod's preStop,
`trainapp stop-jobs`, stops the running jobs first). What
a run killed before its stop snapshot leaves behind that would delay the next one (Ray Data's
autoscaling coordinator keeps a killed controller's resource request for 180 s) is released by the
next driver on the same storage, of this run or another, before it asks for workers
(`release_left_behind`): every controller notes its request, and the run's lease says when it is over.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable

from trainapp.snapshots import lease

log = logging.getLogger("trainapp.ray")

STOP_WAIT_S = 60
"""The RAY_JOB_STOP_WAIT_TIME_S that `make ray-submit` and the KubeRay RayJob give a job: an upper
bound; the job ends as soon as the stop snapshot is registered."""
RAY_DEFAULT_STOP_WAIT_S = 3
"""Ray's own RAY_JOB_STOP_WAIT_TIME_S (ray.dashboard.modules.job.job_supervisor)."""
REQUESTS = ".trainapp-requests"
"""The folder under `ray.storage_path` where each run's controller notes its resource request
(`note_request`)."""


class DriverStop:
    """The driver's stop: SIGTERM in this process (and SIGINT, through `on_sigint`, from Ray Train's own
    handler) asks the workers to stop through `lease`. The handler only records; a thread writes the
    request and says what happens, so nothing in a signal handler takes a lock the main thread may
    hold. A second signal ends the driver at once."""

    def __init__(self, lease: lease.Lease) -> None:
        self.lease, self.signum = lease, 0
        self._asked = threading.Event()
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None
        if threading.current_thread() is threading.main_thread():  # Python takes signals there only
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        threading.Thread(target=self._ask, name="driver-stop", daemon=True).start()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            raise KeyboardInterrupt  # a second notice: stop waiting for the snapshot
        self.signum = signum
        self._asked.set()

    def on_sigint(self) -> bool:
        """Ctrl-C of the driver: True when this is the first, handled as a stop request."""
        if self.signum:
            return False
        self._handle(signal.SIGINT, None)
        return True

    def by(self) -> str:
        if self.signum == signal.SIGINT:
            return "Ctrl-C (SIGINT to the driver)"
        return "ray job stop (SIGTERM to the job's driver)" if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ \
            else "SIGTERM to the driver"

    def _ask(self) -> None:
        self._asked.wait()
        name = signal.Signals(self.signum).name
        try:
            self.lease.request_stop(name, self.by())
        except OSError as e:
            log.warning("%s: could not ask the workers to stop through the run's lease in %s (%s): the job "
                        "ends without a stop snapshot; the resubmission resumes from the newest one",
                        self.by(), self.lease.store.where, e)
            return
        log.warning("%s", self.line())

    def line(self) -> str:
        """What happens now, and what happens if Ray does not wait for it."""
        line = f"{self.by()}: the workers snapshot the step they reach, register it with Ray and end"
        if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
            return line
        wait = os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", str(RAY_DEFAULT_STOP_WAIT_S))
        line += f"; Ray kills the job {wait} s after its stop (RAY_JOB_STOP_WAIT_TIME_S)"
        if float(wait) < STOP_WAIT_S:
            line += (f": if the snapshot is not registered by then, the resubmission resumes from the one "
                     f"before; set RAY_JOB_STOP_WAIT_TIME_S={STOP_WAIT_S} in the job's runtime_env env_vars "
                     f"(make ray-submit and k8s/kuberay/rayjob.train.yaml do)")
        return line

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def summary(self, result_metrics: dict[str, Any]) -> dict[str, Any]:
        """The driver's summary of a stopped run: who asked, the step and the exit code (128 + signal)."""
        return {"stopped_by": self.by(), "exit_code": 128 + self.signum, "step": result_metrics.get("step")}


def note_request(storage: str, requester: str, run_dir: str, generation: int) -> None:
    """The controller of the run `run_dir` (lease `generation`) asks Ray Data's autoscaling coordinator
    for its workers as `requester`: one small file in STORAGE/.trainapp-requests/ says so, for whichever
    driver comes next to cancel it once that run is over (`release_left_behind`)."""
    folder = Path(storage) / REQUESTS
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{requester}.tmp"
    tmp.write_text(json.dumps({"requester": requester, "run_dir": run_dir, "generation": generation}))
    tmp.replace(folder / f"{requester}.json")


def _over(note: dict[str, Any]) -> bool:
    """The run attempt that made the request `note` is over: its lease generation was taken over or
    released, or its driver (on this host) is gone. A driver on another host that still renews it is
    not over, and neither is one whose lease cannot be read now."""
    try:
        gen, record = lease.current(lease.store_at(note["run_dir"]))
    except OSError:
        return False
    if gen != note["generation"]:  # taken over since, or the run directory (and its lease) deleted
        return gen > note["generation"] or gen == 0
    return record is not None and (bool(record.get("released")) or lease.gone(record.get("holder", {})))


def release_left_behind(storage: str) -> list[str]:
    """Before this driver asks for workers: cancel the resource requests that runs under `storage` which
    are over left with the coordinator (a controller killed with its job cancels nothing, and the
    request holds the cluster for an elastic run until it expires, 180 s); forget the ones whose runs
    ended. Returns the ids cancelled."""
    folder = Path(storage) / REQUESTS
    stale = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            note = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _over(note):
            stale.append((path, note["requester"]))
    if not stale:
        return []
    from trainapp.launch.ray.private.resource_requests import cancel_resource_requests

    cancelled = cancel_resource_requests([r for _, r in stale])
    for path, _ in stale if cancelled else []:
        path.unlink(missing_ok=True)
    return cancelled


def stop_jobs(address: str, wait_s: float, poll_s: float = 1.0) -> int:
    """`trainapp stop-jobs`, a head pod's preStop (k8s/kuberay/rayjob.train.yaml): stop every job of the
    cluster at `address` (the dashboard's URL) that is pending or running, as `ray job stop` does, so
    each trainapp driver asks its workers for the snapshot of the step they reached; wait up to `wait_s`
    for them to end. KubeRay terminates a deleted or suspended RayJob's pods without stopping its Ray
    job: this hook is where Kubernetes lets it happen first. The exit code: 0 when all ended, 1 else."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address)
    live = (JobStatus.PENDING, JobStatus.RUNNING)
    ids = [j.submission_id for j in client.list_jobs() if j.status in live and j.submission_id]
    for sid in ids:
        client.stop_job(sid)
    print(f"trainapp stop-jobs: asked {len(ids)} job(s) to stop: {', '.join(ids) or 'none running'}",
          flush=True)
    deadline = time.monotonic() + wait_s
    left = list(ids)
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = [sid for sid in left if client.get_job_status(sid) in live]
    if left:
        print(f"trainapp stop-jobs: {', '.join(left)} still running after {wait_s:g} s", flush=True)
        return 1
    return 0
