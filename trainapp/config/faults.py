"""Config sections of the faults a run survives: the hang watchdog, preemption notices, and the drills
that cause a fault on purpose."""

from __future__ import annotations

import signal
from typing import Literal, Optional

from pydantic import Field
from pydantic.dataclasses import dataclass

from trainapp.config.base import STRICT
from trainapp.errors import ConfigError


@dataclass(config=STRICT)
class FaultSection:
    """The hang watchdog (trainapp/faults/heartbeat.py)."""

    hang_timeout_s: float = Field(default=60.0, ge=0)
    """Hung-rank watchdog: a rank whose training thread made no progress (no step, data batch, eval
    batch or snapshot chunk) for this long dumps its stacks to `run.dir/hangs/`, says so in one line and
    exits with 124, so the launcher restarts the group from the newest snapshot. A rank blocked in a
    collective by a hung peer counts as hung too, 2 s later, so that the hung rank is on record first.
    0: off (the process-group timeout remains)."""
    hang_startup_s: float = Field(default=600.0, gt=0)
    """The watchdog's allowance until the first step is done (imports, data, compilation, the first
    collective): first steps are slow."""


@dataclass(config=STRICT)
class DrillSection:
    """Faults caused on purpose, to see them survived (trainapp/faults/drills.py). The step drills fire
    once: a marker in `run.dir` stops them from firing again after the restart."""

    rank: int = Field(default=0, ge=0)
    """The rank the step drills (`kill_at_step`, `hang_at_step`, `oom_at_step`) act on."""
    kill_at_step: Optional[int] = Field(default=None, ge=1)
    """Rank `drill.rank` kills itself with SIGKILL after optimizer step N, as a lost node would."""
    hang_at_step: Optional[int] = Field(default=None, ge=1)
    """Rank `drill.rank` stops making progress after optimizer step N (its training thread sleeps, as a
    stuck data loader would)."""
    oom_at_step: Optional[int] = Field(default=None, ge=1)
    """Rank `drill.rank` raises `torch.OutOfMemoryError` after optimizer step N, as a CUDA allocation
    beyond the device's memory would: the rank records the failure with its memory, its peers follow
    it out, the launcher restarts the group."""
    kill_in_memory_copy_at_step: Optional[int] = Field(default=None, ge=1)
    """Rank `drill.rank` kills itself with SIGKILL halfway through writing its memory-tier copy of step N
    (`snapshot.memory_every_steps`): the copy is torn, and the restart must not use it."""
    snapshot_write_delay_s: float = Field(default=0.0, ge=0)
    """Sleep this long inside every snapshot write, after `state.pt` and before the `meta.json` that
    completes it, so a kill can land mid-write. A sharded snapshot (`parallel.strategy=fsdp`) instead
    writes every rank's shards as a slow disk would, over about this long, the files growing the whole
    time."""
    slow_rank: Optional[int] = Field(default=None, ge=0)
    """This rank's every step takes `drill.slow_ms` longer, as on a throttled GPU or a slow disk."""
    slow_ms: float = Field(default=100.0, gt=0)
    """How much longer each step of `drill.slow_rank` takes, in milliseconds."""
    slow_phase: Literal["data", "compute", "optim"] = "compute"
    """Where `drill.slow_rank` loses it: waiting for data, between forward and backward, or the optimizer."""


# Signals that cannot be caught (KILL, STOP) or that mean a crash or plumbing: never a preemption notice.
_NOT_NOTICES = frozenset({"SIGKILL", "SIGSTOP", "SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT",
                          "SIGPIPE"})


@dataclass(config=STRICT)
class PreemptSection:
    """A preemption notice (SIGTERM from Kubernetes, `docker stop`, a spot reclaim, Slurm's `--signal`;
    a Ray node drain) becomes a snapshot of the step reached, then an exit with 128 + the signal."""

    signals: list[str] = Field(default_factory=list)
    """Signals that also mean "preempted", besides SIGTERM and SIGINT (always handled), e.g.
    `[SIGUSR1]` when a scheduler signals the training processes themselves with it."""
    grace_s: float = Field(default=25.0, gt=0)
    """From the signal to the exit, at most: if the stop cannot be agreed and the snapshot written in
    this time (a peer gone or hung), the process exits anyway and the newest valid snapshot stays what
    it was. Keep it under the platform's grace period (Kubernetes and `docker stop` default to 30 and
    10 s; see k8s/ and docs/preemption.md)."""
    ray_poll_s: float = Field(default=2.0, ge=0)
    """Under Ray Train, while a node of the run is drained (none before): seconds between
    `get_preemption_info()` polls, each with a snapshot; training goes on, and the node's death costs
    at most this long of training plus a vote interval (0.5 s). 0: off (docs/preemption.md)."""

    def __post_init__(self) -> None:
        names = []
        for raw in self.signals:
            name = raw.strip().upper()
            name = name if name.startswith("SIG") else "SIG" + name
            if name in _NOT_NOTICES or not isinstance(getattr(signal, name, None), signal.Signals):
                raise ConfigError(f"preempt.signals: {raw!r} is not a signal a notice can use; name one such "
                                  "as SIGUSR1, SIGUSR2 or SIGHUP")
            names.append(name)
        self.signals = names


