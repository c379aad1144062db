"""Live metrics under Ray: the figures of trainapp/observe/live.py recorded with `ray.util.metrics` in
each Ray Train worker. Ray's metrics agent on the worker's node exports them (named `ray_trainapp_*`)
on the node's metrics export port, which Ray's Prometheus service discovery (and KubeRay's PodMonitor)
already scrapes: nothing else to open or configure.
"""

from __future__ import annotations

from trainapp.group import DistContext
from trainapp.observe.live import BADPUT, RANK, RUN, LiveMetrics


class RaySink:
    """`Sink` over Ray's gauges, made in this worker process."""

    def __init__(self) -> None:
        from ray.util.metrics import Gauge

        self.gauges = {f"trainapp_{n}": Gauge(f"trainapp_{n}", h, tag_keys=("run",)) for n, h in RUN}
        self.gauges["trainapp_" + BADPUT[0]] = Gauge("trainapp_" + BADPUT[0], BADPUT[1],
                                                     tag_keys=("run", "cause"))
        self.gauges.update({f"trainapp_{n}": Gauge(f"trainapp_{n}", h, tag_keys=("run", "rank"))
                            for n, h in RANK})

    def set(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.gauges[name].set(value, tags=labels)

    def close(self) -> None:
        pass  # Ray's agent forgets a finished worker's series by itself


def live(enabled: bool, ctx: DistContext, run: str) -> LiveMetrics | None:
    """This worker's live metrics for the run named `run` (its own rank's figures; rank 0's also the
    run's), or None when not `enabled` (`observe.ray_metrics`)."""
    return LiveMetrics(RaySink(), run, ctx.is_main, {ctx.rank}) if enabled else None
