"""What differs between the Ray versions trainapp supports (trainapp.launch.ray.checks.SUPPORTED): the
private hooks some of them lack or shape differently, found by looking at the installed Ray (never by
its version number), each with its fallback to Ray's public behaviour and the one line that says what
is lost. The rest of Ray's private API (the other modules of trainapp/launch/ray/private/) is the same
in all of them. docs/ray.md's "Ray versions" table lists these with what each fallback costs.

- `drain_notices`: the training loop hears of a node drained for preemption from Ray Train's
  preemption watcher (`ray.train.get_preemption_info`, public from Ray 2.58; the watcher's poll
  interval is a private variable from 2.57). Without it the loop hears of nothing until its
  processes get SIGTERM (`trainapp drain` or `trainapp node`, a pod's preStop, Ray stopping the node):
  the snapshot comes at the signal instead of at the drain.
- `cluster_reread`: an elastic run's lost or returning node is seen at once by Ray Data's autoscaling
  coordinator, whose cluster view sizes the group (trainapp/launch/ray/private/node_loss.py's
  `NodeLossWatch`, trainapp/launch/ray/resize.py's `ResizeSnapshot`). Ray 2.60 re-reads it on request
  (`get_reserved_resources(recompute=True)`); Ray 2.55 to 2.59 run the same re-read as the
  coordinator's private periodic `_tick`. Without either: its own refresh, every 20 s.

Also here, as it is a lookup with a fallback too: `logs_dir`, the Ray session's log directory, from
the private `ray._private.worker._global_node`.

Private names: those every supported Ray has are in PRIVATE_NAMES (the coordinator's actor class and
getter, the elastic policy's class, the driver's node); OPTIONAL_NAMES lists the ones only some have,
never assumed: tests/test_ray_compat.py's table says which Ray offers which.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import ray


def _attr(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


_CONSTANTS = "ray.train.v2._internal.constants"
_COORDINATOR = "ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator"
_ELASTIC = "ray.train.v2._internal.execution.scaling_policy.elastic"
_WORKER = "ray._private.worker"

PRIVATE_NAMES = (
    (_COORDINATOR, "_AutoscalingCoordinatorActor"),
    (_COORDINATOR, "get_or_create_autoscaling_coordinator"),
    (_ELASTIC, "ElasticScalingPolicy"),
    (_WORKER, "_global_node"),
)
"""(module, name) of the private Ray names looked up here that every supported Ray has;
tests/test_ray_compat.py imports each one."""
OPTIONAL_NAMES = (
    (_CONSTANTS, "PREEMPTION_POLL_INTERVAL_S_ENV_VAR"),
    (_COORDINATOR, "_AutoscalingCoordinatorActor.get_reserved_resources"),
    (_COORDINATOR, "_AutoscalingCoordinatorActor._tick"),
    (_ELASTIC, "ElasticScalingPolicy.GET_RESERVED_RESOURCES_INTERVAL_S"),
    (_ELASTIC, "ElasticScalingPolicy.GET_ALLOCATED_RESOURCES_INTERVAL_S"),
)
"""(module, name) of the private hooks only some supported Rays have (a dotted name: an attribute of
a class there), looked up with a fallback; tests/test_ray_compat.py's table says which Ray has which."""

PREEMPTION_POLL_INTERVAL_S_ENV_VAR = _attr(_CONSTANTS, "PREEMPTION_POLL_INTERVAL_S_ENV_VAR")
"""The preemption watcher's poll interval variable (Ray 2.57 on), None before."""
_ACTOR = _attr(_COORDINATOR, "_AutoscalingCoordinatorActor")
_RESERVED = getattr(_ACTOR, "get_reserved_resources", None)
RECOMPUTE = _RESERVED is not None and "recompute" in inspect.signature(_RESERVED).parameters
"""The coordinator re-reads the cluster on request (Ray 2.60)."""
TICK = callable(getattr(_ACTOR, "_tick", None))
"""The coordinator's periodic re-read can be run now (every supported Ray)."""
_POLICY = _attr(_ELASTIC, "ElasticScalingPolicy")
RESERVED_CACHE_S = float(getattr(_POLICY, "GET_RESERVED_RESOURCES_INTERVAL_S", None)
                         or getattr(_POLICY, "GET_ALLOCATED_RESOURCES_INTERVAL_S", None) or 1.0)
"""How long Ray Train's elastic policy keeps the coordinator's answer (renamed in Ray 2.58; 1 s in all)."""


def drain_notices() -> bool:
    """Ray Train tells the workers of a drained node, and trainapp can read it."""
    return (PREEMPTION_POLL_INTERVAL_S_ENV_VAR is not None
            and _attr("ray.train", "get_preemption_info") is not None)


def cluster_reread() -> bool:
    return RECOMPUTE or TICK


def reread_cluster(requester: str) -> None:
    """Have Ray Data's autoscaling coordinator, whose cluster view sizes elastic groups, re-read the nodes
    now (it does every 20 s by itself): the re-read re-reserves for every requester; `requester` is the
    caller's own id. RuntimeError when this Ray offers no way to (`cluster_reread()` is False)."""
    coordinator = _attr(_COORDINATOR, "get_or_create_autoscaling_coordinator")()
    if RECOMPUTE:
        ray.get(coordinator.get_reserved_resources.remote(requester, recompute=True), timeout=10)
    elif TICK:
        ray.get(coordinator._tick.remote(), timeout=10)
    else:
        raise RuntimeError("this Ray's autoscaling coordinator cannot be asked to re-read the cluster")


def lost(drains: bool, elastic: bool) -> list[str]:
    """One line per feature this Ray cannot give a run that wants it (`drains`: preempt.ray_poll_s is
    on; `elastic`: a [min, max] ray.num_workers)."""
    v, out = ray.__version__, []
    if drains and not drain_notices():
        out.append(f"ray {v}: no drain notices reach the training loop (Ray Train reads them from Ray 2.58 "
                   "on): a drained node's workers snapshot when they get SIGTERM (trainapp drain/node, a "
                   "pod's preStop), not at the drain; preempt.ray_poll_s has no effect")
    if elastic and not cluster_reread():
        out.append(f"ray {v}: Ray Data's autoscaling coordinator cannot be asked to re-read the cluster: an "
                   "elastic run sees a lost or returning node at the coordinator's own refresh, up to 20 s "
                   "later")
    return out


def logs_dir() -> str | None:
    """The Ray session's log directory on the driver's node (where each node keeps its processes' logs,
    under the same session name), or None where this Ray keeps it elsewhere: for the one line of a
    failed start, which names where Ray's own lines about it went."""
    node = getattr(_attr(_WORKER, "_global_node"), "get_logs_dir_path", None)
    try:
        return str(node()) if callable(node) else None
    except Exception:  # a driver that is not connected, or a Ray that changed: the line says it generically
        return None
