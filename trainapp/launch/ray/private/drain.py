"""Whether Ray Train has told this worker of a drain: `drain_pending`, in the training thread
(trainapp/launch/ray/publish.py's `RayDrainNotice` asks it before it asks Ray).

What Ray has no public way to do: ask Ray Train about a drain only when there is one.
`ray.train.get_preemption_info()` is a barrier of every worker through the synchronization actor (rank
0's answer, broadcast), and the worker's own copy of the watcher's notice, which it broadcasts, is in
the private train context.

Private names: `get_train_context` (`ray.train.v2._internal.execution.context`).
"""

from __future__ import annotations

from trainapp.launch.ray.private import unsupported

PRIVATE_NAMES = (
    ("ray.train.v2._internal.execution.context", "get_train_context"),
)
"""(module, name) of every private Ray name used here; tests/test_ray_compat.py imports each one."""

try:  # an import error here is a Ray version trainapp was not written for, said in one line
    from ray.train.v2._internal.execution.context import get_train_context as _train_context
except ImportError as e:
    raise unsupported(e, __name__) from None


def drain_pending() -> bool:
    """In a Ray Train worker's training thread: whether Ray Train's preemption watcher has told this
    worker of a drain (`mark_preempt` sets the worker's copy; `get_preemption_info()` broadcasts rank
    0's). True when that copy cannot be read (another Ray's layout): the loop then asks Ray by time,
    as it would without this check."""
    try:
        return _train_context().preemption_context.preemption_info is not None
    except (AttributeError, RuntimeError):
        return True
