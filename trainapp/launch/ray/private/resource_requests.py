"""The resource requests of runs killed with their job, cancelled by the next driver: `RequesterLog`,
a callback in Ray Train's controller, notes the id under which the run asks for its workers'
resources; `cancel_resource_requests` (trainapp/launch/ray/stop.py's `release_left_behind`) cancels
those of runs that ended without cancelling them.

What Ray has no public way to do: list or cancel another controller's request. A controller killed
with its job cancels nothing, and its request to Ray Data's autoscaling coordinator expires only after
180 s, during which an elastic run's next start may wait for it. Ray Train's scaling policy names the
request `train-<run id>` (`ScalingPolicy.after_controller_start`, `TrainRunContext.run_id`), which
`RequesterLog` sees at the controller's start through the private `ControllerCallback` (callbacks.py);
the coordinator, internal to Ray Data, takes that id in its `cancel_request`.

Private names: `get_or_create_autoscaling_coordinator`
(`ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from trainapp.launch.ray.private import say, unsupported
from trainapp.launch.ray.private.callbacks import ControllerCallback

PRIVATE_NAMES = (
    ("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator",
     "get_or_create_autoscaling_coordinator"),
)
"""(module, name) of every private Ray name used here; tests/test_ray_compat.py imports each one."""

try:  # an import error here is a Ray version trainapp was not written for, said in one line
    import ray
except ImportError as e:
    raise unsupported(e, __name__) from None

if TYPE_CHECKING:
    from trainapp.launch.ray.private.callbacks import TrainRunContext


class RequesterLog(ControllerCallback):
    """Notes the id under which this run's controller asks Ray Data's autoscaling coordinator for the
    workers' resources (Ray Train's scaling policy names it `train-<run id>`) with `note(requester)`: a
    controller killed with its job cancels nothing, and the next driver cancels it
    (trainapp/launch/ray/stop.py's `release_left_behind`)."""

    def __init__(self, note: Callable[[str], None]) -> None:
        self.note = note

    def after_controller_start(self, train_run_context: TrainRunContext) -> None:
        try:
            self.note(f"train-{train_run_context.run_id}")
        except OSError as e:  # information only: a full disk must not fail the controller
            say(f"could not note the run's resource request: {e}")


def cancel_resource_requests(ids: list[str]) -> list[str]:
    """Cancel the coordinator's requests `ids` (those it still holds); the ids it was asked to cancel.
    Nothing, with one warning line, when the coordinator cannot be reached: the requests then expire."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    try:
        coordinator = get_or_create_autoscaling_coordinator()
        ray.get([coordinator.cancel_request.remote(requester_id=i) for i in ids], timeout=10)
    except Exception as e:
        logging.getLogger("trainapp.ray").warning(
            "could not cancel the resource requests earlier attempts left (%s: %s): an elastic run may wait "
            "up to 180 s for them to expire", e.__class__.__name__, e)
        return []
    return ids
