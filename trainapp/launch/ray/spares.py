"""Spare worker processes under Ray: on each node, idle Ray worker processes that have already done a
training worker's imports, so that the group Ray Train starts after a failure begins in them instead of
in fresh processes (a fresh worker's boot, Ray Train's and torch's imports are seconds of the restart:
docs/ray.md, "Spare workers").

How it works, with Ray's public parts where they exist:
- The driver gives the job a `worker_process_setup_hook` (`HOOK`, this module's `preload`): Ray runs it
  at the start of every worker process of the job.
- The training workers' own runtime env (Ray Train's `worker_runtime_env`) carries `PRELOAD`, the modules a
  training worker imports. Ray starts idle processes only for a runtime env it has seen, so a spare gets
  the training workers' env (and `PRELOAD`), and Ray hands it to a training worker only.
- Once a worker has trained `ray.spare_after_s`, each node's first worker tops the node up to one spare
  per training worker there: it leaves a claim file per spare here (`want`), then asks the node's Raylet
  for the processes (trainapp/launch/ray/private/prestart.py).
- `preload` does its imports only in a process that takes a claim. A process Ray starts for a training
  worker on its own finds none, and goes on as it would without spares: its imports run later, partly
  while the process group forms (trainapp/launch/ray/setup.py).

This module imports neither Ray nor torch at import time: every process of the job imports it for the
hook, and Ray ends a process whose hook raises, so `preload` never does.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from trainapp.launch.ray import node_memory

HOOK = "trainapp.launch.ray.spares.preload"
PRELOAD = "TRAINAPP_RAY_PRELOAD"
"""In the training workers' runtime env: the modules a spare imports, comma-separated."""
READY = "TRAINAPP_RAY_SPARE_READY"
"""Set by `preload` in a spare: when its imports were done (the start record's `worker_preloaded`)."""
KEEP_S = 7 * 24 * 3600
"""How long Ray keeps a spare before its idle reaper may end it; the job's end ends it sooner."""
CLAIM_S = 120.0
"""A claim file this old is stale (its process never started, or started for another claim) and dropped."""


COST = "spare-bytes"
"""In the node's folder of spares: the private bytes of the newest spare there, once its imports were done
(its cost to the node's memory)."""
COST_BEFORE = 512 * 2**20
"""A spare's cost before one on the node has said (spares measured 0.27 to 0.45 GB: docs/ray.md)."""
MARGIN = 0.05
"""The share of the node's memory left free below Ray's kill line after the spares: the steps' memory
peaks between the samples the training worker takes of it."""
PRUNE_S = 24 * 3600.0
"""A job's folder untouched this long is another job's leftover (its driver's node removes it at the end;
the other nodes' stay until this): the next top-up on the node removes it."""


def root() -> Path:
    """The node's folder of spares: under TMPDIR as set now (a process that started Ray's nodes, a test or a
    benchmark, finds its nodes' folder: its `tempfile` may have cached another)."""
    return Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / f"trainapp-{os.getuid()}" / "ray-spares"


def folder(job_id: str, node_id: str) -> Path:
    """Where the claims and the idle spares of one job on one node are kept (node-local)."""
    return root() / job_id / node_id


def forget(job_id: str) -> None:
    """The driver, as its job ends: its job's folders on this node go (Ray ends the job's idle spares)."""
    shutil.rmtree(root() / job_id, ignore_errors=True)


def _prune(keep: str) -> None:
    """Other jobs' folders untouched for PRUNE_S, unless a spare of theirs still lives (a job that has run
    that long)."""
    now = time.time()
    for job in root().glob("*"):
        try:
            if job.name == keep or not job.is_dir() or now - job.stat().st_mtime <= PRUNE_S:
                continue
            if not any(idle(node) for node in job.iterdir()):
                shutil.rmtree(job, ignore_errors=True)
        except OSError:
            continue


def _here() -> Path:
    import ray

    ctx = ray.get_runtime_context()
    return folder(ctx.get_job_id(), ctx.get_node_id())


def preload() -> None:
    """The job's setup hook, at the start of each of its worker processes: a spare (a process with
    `PRELOAD` set that takes a claim) imports the modules, then says it is idle (a `spare-PID` file) and
    when it was ready (`READY`); every other process returns at once."""
    modules = os.environ.get(PRELOAD)
    if not modules:
        return
    try:
        here = _here()
        if not _claim(here):
            return
        for name in modules.split(","):
            try:
                importlib.import_module(name)
            except Exception:  # the worker's own import of it, later, says what is wrong
                continue
        ready = time.time()
        (here / f"spare-{os.getpid()}").write_text(f"{ready}\n")
        os.environ[READY] = str(ready)
        _say_cost()
    except Exception:  # a hook that raises ends the process; without a spare nothing is lost
        return


def _say_cost() -> None:
    """Leave this spare's private bytes for the node's next top-up (`cost`)."""
    tmp = root() / f"{COST}.{os.getpid()}"
    tmp.write_text(f"{node_memory.private_bytes()}\n")
    os.replace(tmp, root() / COST)


def cost() -> int:
    """What a spare costs this node's memory: the newest spare's measure, else `COST_BEFORE`."""
    try:
        return int((root() / COST).read_text()) or COST_BEFORE
    except (OSError, ValueError):
        return COST_BEFORE


def _claim(here: Path) -> bool:
    """Take one fresh claim file in `here` (removing it is the claim: one process wins each); stale ones
    go on the way."""
    try:
        names = sorted(n for n in os.listdir(here) if n.startswith("want-"))
    except OSError:
        return False
    now = time.time()
    for name in names:
        path = here / name
        try:
            fresh = now - path.stat().st_mtime < CLAIM_S
            path.unlink()
        except OSError:  # another process took it
            continue
        if fresh:
            return True
    return False


def taken() -> float | None:
    """In a training worker: when this process became ready as a spare (None: a fresh process). Its
    `spare-PID` file goes: the spare is idle no more."""
    ready = os.environ.pop(READY, None)
    if ready is None:
        return None
    try:
        (_here() / f"spare-{os.getpid()}").unlink(missing_ok=True)
    except Exception:  # the count of idle spares is then one high until that process is gone
        pass
    return float(ready)


def idle(here: Path) -> int:
    """Spares waiting on this node: `spare-PID` files whose process lives (a stale one is removed)."""
    n = 0
    for path in here.glob("spare-*"):
        try:
            os.kill(int(path.name.split("-", 1)[1]), 0)
            n += 1
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            continue
    return n


def want(here: Path, n: int) -> None:
    """Leave `n` claim files in `here`, one for each spare about to be asked for."""
    here.mkdir(parents=True, exist_ok=True)
    for _ in range(n):
        (here / f"want-{uuid.uuid4().hex}").touch()


def room(peak: node_memory.Memory, each: int, kill_at: float) -> int:
    """How many spares of `each` bytes fit on a node whose memory peaked at `peak` and whose processes Ray
    ends from `kill_at` of its total on, `MARGIN` of the total left free."""
    return max(0, int(((kill_at - MARGIN) * peak.total - peak.used) // max(each, 1)))


def top_up(per_node: int, keep_s: int, peak: node_memory.Memory) -> int:
    """On a training worker: ask this node's Raylet for the spares that bring its idle ones to
    `per_node`, each kept at least `keep_s`, as many of them as the node's memory has room for at its
    `peak` (one line on stderr when that is fewer); returns how many were asked for."""
    from trainapp.launch.ray.private import prestart

    here = _here()
    _prune(here.parent.name)
    lacking = max(0, per_node - idle(here) - _pending(here))
    each, kill_at = cost(), node_memory.kill_at()
    n = min(lacking, room(peak, each, kill_at))
    if n < lacking:
        gib = 2.0**30
        print(f"trainapp: ray.spare_workers: {n} of {lacking} spare process(es) on this node: its memory "
              f"peaked at {peak.used / gib:.2f} of {peak.total / gib:.2f} GiB, Ray's memory monitor ends "
              f"processes from {kill_at:.0%} of it ({node_memory.THRESHOLD_ENV}), and a spare holds "
              f"{each / gib:.2f} GiB; give the node more memory to have them (the restarted group then "
              "starts in fresh processes, seconds later)", file=sys.stderr, flush=True)
    if n:
        want(here, n)
        prestart.prestart(n, keep_s)
    return n


def _pending(here: Path) -> int:
    """Fresh claims not yet taken (spares asked for that are still starting)."""
    now = time.time()
    n = 0
    for path in here.glob("want-*"):
        try:
            n += now - path.stat().st_mtime < CLAIM_S
        except OSError:
            continue
    return n
