"""The kubelet's probe rules for one container, without any I/O: which probe is due, and what a result means.

- Nothing runs before initialDelaySeconds, then each probe every periodSeconds.
- A startup probe, while it has not passed, holds the other two back; failureThreshold failures of it
  restart the container.
- Readiness: ready after successThreshold passes in a row, not ready after failureThreshold failures in a
  row; a container starts not ready. Without a readiness probe a running container is ready.
- Liveness: failureThreshold failures in a row restart the container.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .podspec import ProbeSpec


@dataclass
class Counter:
    spec: ProbeSpec
    next_at: float
    passes: int = 0
    failures: int = 0


@dataclass
class ContainerProbes:
    specs: dict[str, ProbeSpec]
    started_at: float
    counters: dict[str, Counter] = field(default_factory=dict)
    started: bool = False  # the startup probe has passed (or there is none)
    ready: bool = False

    def __post_init__(self) -> None:
        self.counters = {k: Counter(s, self.started_at + s.initial_delay) for k, s in self.specs.items()}
        self.started = "startup" not in self.specs
        self.ready = self.started and "readiness" not in self.specs

    def due(self, now: float) -> list[str]:
        """The probes to run now, startup first."""
        kinds = ["startup"] if not self.started else ["liveness", "readiness"]
        return [k for k in kinds if k in self.counters and now >= self.counters[k].next_at]

    def record(self, kind: str, ok: bool, now: float) -> str | None:
        """Take one result; returns "restart" when the container must be restarted, else None."""
        c = self.counters[kind]
        c.next_at = now + c.spec.period
        c.passes, c.failures = (c.passes + 1, 0) if ok else (0, c.failures + 1)
        if kind == "startup":
            if ok and c.passes >= c.spec.success_threshold:
                self.started = True
                self.ready = "readiness" not in self.specs
                for k in ("liveness", "readiness"):  # their initial delay counts from the container's start
                    if k in self.counters:
                        self.counters[k].next_at = max(now, self.counters[k].next_at)
            return "restart" if c.failures >= c.spec.failure_threshold else None
        if kind == "readiness":
            if ok and c.passes >= c.spec.success_threshold:
                self.ready = True
            elif not ok and c.failures >= c.spec.failure_threshold:
                self.ready = False
            return None
        return "restart" if c.failures >= c.spec.failure_threshold else None
