"""The base classes of trainapp's callbacks in Ray Train's controller (node_loss.py's `NodeLossWatch`,
resource_requests.py's `RequesterLog`, trainapp/launch/ray/resize.py's `ResizeSnapshot`), and the
types of their hooks' arguments.

What Ray has no public way to do: see the controller's failure and resize decisions, its start, and
the worker group's start, polls and shutdown. Only the private `ControllerCallback` and
`WorkerGroupCallback` (`ray.train.v2._internal.execution.callback`) offer those hooks; the public
`UserCallback` sees reports and worker exceptions only. The hooks' argument types
(`ray.train.v2._internal.execution`'s `TrainRunContext`, `FailureDecision`, `ResizeDecision`,
`WorkerGroup`, `WorkerGroupContext`, `WorkerGroupPollStatus`) are private too; they are named here for
typing only (mypy checks them), and a module outside this folder takes them from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainapp.launch.ray.private import unsupported

PRIVATE_NAMES = (
    ("ray.train.v2._internal.execution.callback", "ControllerCallback"),
    ("ray.train.v2._internal.execution.callback", "WorkerGroupCallback"),
)
"""(module, name) of every private Ray name used here; tests/test_ray_compat.py imports each one."""

try:  # an import error here is a Ray version trainapp was not written for, said in one line
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
except ImportError as e:
    raise unsupported(e, __name__) from None

if TYPE_CHECKING:  # the hooks' argument types: private, so named here only
    from ray.train.v2._internal.execution.context import TrainRunContext as TrainRunContext
    from ray.train.v2._internal.execution.failure_handling import FailureDecision as FailureDecision
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision as ResizeDecision
    from ray.train.v2._internal.execution.worker_group import WorkerGroup as WorkerGroup
    from ray.train.v2._internal.execution.worker_group import WorkerGroupContext as WorkerGroupContext
    from ray.train.v2._internal.execution.worker_group import WorkerGroupPollStatus as WorkerGroupPollStatus

__all__ = ["ControllerCallback", "WorkerGroupCallback"]
