"""Live metrics, where the ecosystem scrapes them: a Prometheus endpoint (`prometheus_client`) on each
node under torchrun, Slurm or alone (`observe.prometheus_port`), or, in a Ray Train worker, Ray's own
metrics (`ray.util.metrics`, trainapp/launch/ray/metrics.py), which each node's Ray metrics agent serves
where Ray's Prometheus scrape already looks.

Who exports what, so that a sum over scrape targets counts each figure once: the run's figures (step,
loss, samples/s, snapshot, goodput so far, restarts) come from rank 0 only; a rank's figures (its step
time, own work, data wait, straggler flag) from the process that serves its node (the node's lowest
rank) or, under Ray, from the rank itself. Every rank already receives every rank's timings in the log
interval's one all-gather (trainapp/core/loop.py), so serving a node's ranks costs no communication.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from trainapp.group import DistContext

log = logging.getLogger("trainapp.core.loop")

RUN = (
    ("step", "Optimizer steps done"),
    ("total_steps", "Optimizer steps the run trains to"),
    ("world_size", "Ranks training in this attempt"),
    ("samples_per_second", "Training samples per second over the last log interval, all ranks"),
    ("loss", "Mean training loss over the last log interval"),
    ("learning_rate", "Learning rate at the last log interval"),
    ("snapshot_step", "Step of the newest snapshot written"),
    ("snapshot_timestamp_seconds", "Unix time the newest snapshot was written"),
    ("snapshot_age_seconds", "Seconds since the newest snapshot was written (as of the last update)"),
    ("goodput_ratio",
     "Share of the run's wall time so far, over every attempt, spent in steps the model kept"),
    ("wall_seconds", "The run's wall time so far, over every attempt"),
    ("restarts", "Attempts of this run before the current one"),
    ("steps_redone", "Steps trained again because a restart resumed from an earlier snapshot"),
)
"""The run's gauges (`trainapp_` + name), label `run`; rank 0 only."""
BADPUT = ("badput_seconds",
          "Seconds of the run's wall time lost so far, by cause (trainapp report lists them)")
"""The gauge with a `cause` label beside `run`."""
RANK = (
    ("rank_step_seconds", "A rank's mean step time over the last log interval"),
    ("rank_busy_seconds", "A rank's own work per step: its step without waiting for its peers"),
    ("rank_data_wait_seconds", "A rank's wait for its batches per step"),
    ("straggler", "1 while the rank is a named straggler (observe.straggler_ratio), else 0"),
)
"""Per-rank gauges, labels `run` and `rank`; served by the rank's node (under Ray: by the rank)."""
ACCOUNT_EVERY_S = 15.0
"""How often rank 0 remakes the goodput account (it reads metrics.jsonl): a scrape interval's worth."""


class Sink(Protocol):
    """Where gauges go: a Prometheus registry, or Ray's metrics."""

    def set(self, name: str, value: float, labels: dict[str, str]) -> None: ...

    def close(self) -> None: ...


class PromSink:
    """The gauges in a registry of their own, served over HTTP by `prometheus_client` on a daemon thread."""

    def __init__(self, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.gauges = {f"trainapp_{n}": Gauge(f"trainapp_{n}", h, ["run"], registry=self.registry)
                       for n, h in RUN}
        self.gauges["trainapp_" + BADPUT[0]] = Gauge("trainapp_" + BADPUT[0], BADPUT[1], ["run", "cause"],
                                                     registry=self.registry)
        self.gauges.update({f"trainapp_{n}": Gauge(f"trainapp_{n}", h, ["run", "rank"],
                                                   registry=self.registry)
                            for n, h in RANK})
        self.server, self.thread = start_http_server(port, addr, registry=self.registry)
        self.port = self.server.server_address[1]

    def set(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.gauges[name].labels(**labels).set(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class LiveMetrics:
    """This process's share of the live metrics: the run's figures when it is rank 0, and the figures of
    `ranks` (the ranks it serves) from every log interval's timings."""

    def __init__(self, sink: Sink, run: str, is_main: bool, ranks: set[int]) -> None:
        self.sink, self.run, self.is_main, self.ranks = sink, run, is_main, ranks
        self._next_account, self._accounts = 0.0, 0
        self._snapshot_at: float | None = None

    def _run(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            if value is not None:
                self.sink.set(f"trainapp_{name}", float(value), {"run": self.run})

    def started(self, step: int, total_steps: int, world_size: int) -> None:
        if self.is_main:
            self._run({"step": step, "total_steps": total_steps, "world_size": world_size})

    def interval(self, record: dict[str, Any]) -> None:
        """A `train` record (every rank makes it; rank 0's figures are the run's)."""
        if not self.is_main:
            return
        self._run({"step": record["step"], "loss": record["loss"], "learning_rate": record["lr"],
                   "samples_per_second": record["samples_per_s"], "world_size": record["world_size"]})
        if self._snapshot_at is not None:
            self._run({"snapshot_age_seconds": time.time() - self._snapshot_at})

    def rank_timings(self, entries: list[dict[str, Any]], flagged: set[int]) -> None:
        """Every rank's entry of a `ranks` record (trainapp/observe/timings.py); the straggler watch's
        currently named ranks."""
        for e in entries:
            if e["rank"] not in self.ranks:
                continue
            labels = {"run": self.run, "rank": str(e["rank"])}
            for name, value in (("rank_step_seconds", e["step_ms"]), ("rank_busy_seconds", e["busy_ms"]),
                                ("rank_data_wait_seconds", e["phase_ms"].get("data", 0.0))):
                self.sink.set(f"trainapp_{name}", value / 1000, labels)
            self.sink.set("trainapp_straggler", float(e["rank"] in flagged), labels)

    def snapshot(self, step: int) -> None:
        if self.is_main:
            self._snapshot_at = time.time()
            self._run({"snapshot_step": step, "snapshot_timestamp_seconds": self._snapshot_at,
                       "snapshot_age_seconds": 0.0})

    def account_due(self) -> bool:
        """Rank 0: time to remake the goodput account: at the start (restarts), at the first log interval
        (the first steps), then at most every ACCOUNT_EVERY_S."""
        if not self.is_main or (self._accounts >= 2 and time.monotonic() < self._next_account):
            return False
        self._accounts += 1
        self._next_account = time.monotonic() + ACCOUNT_EVERY_S
        return True

    def account(self, acc: dict[str, Any] | None) -> None:
        """The goodput account so far (trainapp/observe/goodput.py)."""
        if acc is None:
            return
        self._run({"goodput_ratio": acc["goodput"], "wall_seconds": acc["wall_s"],
                   "restarts": len(acc["attempts"]) - 1, "steps_redone": acc["steps_redone"]})
        for cause, seconds in acc["badput_s"].items():
            self.sink.set("trainapp_" + BADPUT[0], seconds, {"run": self.run, "cause": cause})

    def close(self) -> None:
        self.sink.close()


def serve(port: int, run: str, ctx: DistContext) -> LiveMetrics | None:
    """Every rank, together (one all-gather): the node's lowest rank serves its node's ranks on `port`
    (rank 0's node also the run's figures); None on the other ranks, when `port` is 0, or when the port
    is taken (one warning line: training goes on without)."""
    if not port:
        return None
    # A node is a host and the launcher's node rank: two torchrun agents may share one host.
    key = [os.uname().nodename, os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK"))]
    mine = {r for r, k in enumerate(ctx.all_gather_objects(key)) if list(k) == key}
    if ctx.rank != min(mine):
        return None
    try:
        sink = PromSink(port)
    except OSError as e:
        log.warning("observe.prometheus_port=%d: cannot serve metrics on %s (%s); this node's metrics are "
                    "not served, training goes on; pick a free port", port, key[0], e.strerror or e)
        return None
    log.info("metrics: http://%s:%d/metrics serves rank(s) %s%s", key[0], sink.port,
             ",".join(map(str, sorted(mine))), " and the run's figures" if ctx.is_main else "")
    return LiveMetrics(sink, run, ctx.is_main, mine)
