"""Every rank's step time by phase, gathered at the log interval, and stragglers named.

Each rank splits its wall time into phases as it trains: the loop says which phase it enters
(`PhaseClock.enter`, a clock read and an add), and the same call tells the heartbeat, so the hang
watchdog, the failure records and the timings name the same phases:

- `data`: waiting for the next batch and moving it to the device;
- `compute`: forward and backward, from the moment the wrapped model's own forward starts to the
  moment this rank hands DDP its last gradient bucket;
- `comm`: the rest of forward and backward, i.e. waiting for peers: DDP's broadcast of rank 0's
  buffers before the forward (BatchNorm statistics; a peer late for it makes everyone wait there),
  and the gradient all-reduce after this rank's backward is done. A forward pre-hook on the wrapped
  model and a DDP communication hook (`attach`) take the two moments. Under FSDP the waits are inside
  the forward and backward (each unit's all-gather, again in backward, and its reduce-scatter): hooks
  around them (trainapp/core/parallel/fsdp.py's `time_waits`) call `wait_begins`/`wait_ends`, and what lies
  between moves from the phase to comm; the loop does the same around its own collectives in other
  phases (FSDP's broadcast of rank 0's buffers in `optim`);
- `optim`: clipping, the optimizer and scheduler steps, EMA;
- `snapshot`: the training thread blocked by a snapshot;
- `other`: the loop's own bookkeeping between steps (logging, the stop vote);
- `eval`: evaluation, kept apart: it is not part of a step.

Beside the phases, each rank reports its process's CPU time per step over the interval (`cpu_ms`:
every thread of the process, snapshots and evals included). Wall time shows where a step waits; CPU
time shows what the rank burns, launcher included: under Ray it counts the Ray runtime's own threads
in the worker, which torchrun's workers do not have.

No phase synchronises the device: on CPU the laps are host clock reads; on CUDA they are events on
the current stream (`torch.cuda.Event`), resolved once per log interval, where the loop reads the loss
anyway. `gather` then moves every rank's row to every rank in one small all-gather, which also
carries the loss sums the `train` record needs (so the log interval still costs one collective).
Rank 0 turns the rows into a `ranks` record and feeds `Stragglers`. The module imports no torch
(the report reads its phase names).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch
    from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

PHASES = ("data", "compute", "comm", "optim", "snapshot", "other")
"""The phases a step's time is split into (they add up to the step time)."""
TIMED = (*PHASES, "eval")
BUSY = tuple(p for p in PHASES if p != "comm")
"""A rank's own work: the step without the time spent waiting for its peers."""


class PhaseClock:
    """This rank's seconds by phase since the last `collect()`. `enter(phase)` says what the training
    thread does from now on and tells `on_phase` (the heartbeat's `set_phase`) even when the timings
    are off."""

    def __init__(self, device: torch.device, enabled: bool = True,
                 on_phase: Callable[[str], None] = lambda p: None):
        self.enabled, self.on_phase = enabled, on_phase
        self.current = "other"
        self.cuda = device.type == "cuda"
        if self.cuda:
            import torch

            self._event = torch.cuda.Event
        self.totals = dict.fromkeys(TIMED, 0.0)
        self.steps = 0
        self._pending: list[tuple[str, Any, Any, float]] = []  # CUDA: (phase, start event, end event, sign)
        self._forward: Any = None  # when the wrapped model's forward began, after DDP's buffer broadcast
        self._handoff: Any = None  # when the last gradient bucket went to DDP (set by `hook`)
        self._wait: Any = None  # when the wait for peers now in progress began (FSDP: `wait_begins`)
        self._depth = 0  # nested waits count once (a unit's backward prefetch inside its own all-gather's)
        self._last = self._now() if enabled else None
        self._cpu = time.process_time()  # the process's CPU seconds (all threads) at the interval's start

    def _now(self) -> Any:
        # An instant: a CUDA event (read at `collect`, no sync now) on CUDA, perf_counter seconds on the
        # CPU; which of the two depends on `self.cuda`, so the instants are typed Any.
        if self.cuda:
            event = self._event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _add(self, phase: str, start: Any, end: Any, sign: float = 1.0) -> None:
        if self.cuda:
            self._pending.append((phase, start, end, sign))
        else:
            self.totals[phase] += sign * (end - start)

    def restart(self) -> None:
        """Drop the time since the last `enter`: the first interval starts at the first step, not at
        set-up."""
        if self.enabled:
            self._last = self._now()
            self._cpu = time.process_time()

    def enter(self, phase: str) -> None:
        """From now on the training thread does `phase`: the time since the last `enter` goes to the phase
        it leaves (leaving `compute`, split between compute and the wait for peers: `_leave_compute`)."""
        self.on_phase(phase)
        self._wait, self._depth = None, 0  # a wait never spans phases: one cut short by an error ends here
        if self.enabled:
            if self.current == "compute":
                self._leave_compute()
            else:
                now = self._now()
                self._add(self.current, self._last, now)
                self._last = now
        self.current = phase

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """`name` inside the block, then back to the phase before it (evaluation, a snapshot). An error
        leaves the phase as it is: the rank's failure record names the phase it failed in."""
        before = self.current
        self.enter(name)
        yield
        self.enter(before)

    def _leave_compute(self) -> None:
        """After forward and backward: comm until the wrapped model's forward began, compute until
        the last bucket's hand-off, comm from there on (all compute without DDP, and no all-reduce
        wait in a `no_sync` micro-step)."""
        now, forward, handoff = self._now(), self._forward, self._handoff
        self._forward = self._handoff = None
        begin = self._last
        if forward is not None:
            self._add("comm", begin, forward)
            begin = forward
        if handoff is not None:
            self._add("compute", begin, handoff)
            self._add("comm", handoff, now)
        else:
            self._add("compute", begin, now)
        self._last = now

    def wait_begins(self) -> None:
        """This rank starts waiting for its peers inside the current phase (an FSDP unit's all-gather or
        reduce-scatter): until `wait_ends`, the time is comm, not the phase's own work."""
        self._depth += 1
        if self.enabled and self._depth == 1:
            self._wait = self._now()

    def wait_ends(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._wait is not None:
            now, begin, self._wait = self._now(), self._wait, None
            self._add("comm", begin, now)
            # The phase's own lap, added on leaving it, includes it.
            self._add(self.current, begin, now, sign=-1.0)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The block is a wait for peers (a collective of the loop's own)."""
        self.wait_begins()
        try:
            yield
        finally:
            self.wait_ends()

    def step_done(self) -> None:
        self.steps += 1

    def attach(self, ddp: DistributedDataParallel) -> None:
        """Before `ddp`'s first forward: `hook` as its communication hook, and a forward pre-hook on
        the model it wraps (which DDP calls once its buffers are synchronised)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._allreduce = allreduce_hook
        ddp.register_comm_hook(None, self.hook)
        ddp.module.register_forward_pre_hook(self._forward_begins)

    def _forward_begins(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if self.enabled and module.training:
            self._forward = self._now()

    # Typed in comments: DDP's register_comm_hook reads the `bucket` annotation at run time and refuses
    # anything but the class itself, and this module's annotations are strings (PEP 563).
    def hook(
        self,
        process_group,  # type: torch.distributed.ProcessGroup | None
        bucket,  # type: torch.distributed.GradBucket
    ):  # type: (...) -> torch.futures.Future[torch.Tensor]
        """DDP communication hook: PyTorch's default all-reduce (divide by the world size, sum), noting
        when the last bucket is handed over, which is when this rank's backward is done."""
        if bucket.is_last():
            self._handoff = self._now()
        # Registered with state None: torch's allreduce_hook takes that for the default group, but
        # annotates its first parameter as a ProcessGroup.
        return self._allreduce(process_group, bucket)  # type: ignore[arg-type]

    def collect(self) -> list[float]:
        """[steps, seconds of each phase in TIMED, process CPU seconds] since the last call; starts the
        next interval."""
        if self.cuda and self._pending:
            self._pending[-1][2].synchronize()
            for phase, start, end, sign in self._pending:
                self.totals[phase] += sign * start.elapsed_time(end) / 1000
            self._pending.clear()
        start, self._cpu = self._cpu, time.process_time()
        row = [float(self.steps), *(self.totals[p] for p in TIMED),
               self._cpu - start if self.enabled else 0.0]
        self.totals = dict.fromkeys(TIMED, 0.0)
        self.steps = 0
        return row


def rank_rows(rows: list[list[float]], hosts: list[str]) -> list[dict[str, Any]]:
    """The `ranks` record's entries from every rank's `collect()` row: per rank its host, step time
    (ms), each phase in ms per step and as a share of the step time, the busy time (the step without
    the wait for peers) and the process's CPU time per step."""
    out = []
    for rank, row in enumerate(rows):
        steps = max(row[0], 1.0)
        ms = {p: 1000 * s / steps for p, s in zip(TIMED, row[1:])}
        step_ms = sum(ms[p] for p in PHASES)
        out.append({"rank": rank, "host": hosts[rank] if rank < len(hosts) else None, "steps": int(row[0]),
                    "step_ms": round(step_ms, 3), "busy_ms": round(sum(ms[p] for p in BUSY), 3),
                    "cpu_ms": round(1000 * row[1 + len(TIMED)] / steps, 3),
                    "phase_ms": {p: round(v, 3) for p, v in ms.items()},
                    "share": {p: round(ms[p] / step_ms, 4) if step_ms else 0.0 for p in PHASES}})
    return out


class Stragglers:
    """Rank 0's watch: a rank whose busy time (its step without the wait for peers) is over `ratio`
    times the ranks' median for `intervals` log intervals in a row is a straggler, reported once until
    it is back under the line. The phase named is the one furthest over its own median."""

    def __init__(self, ratio: float, intervals: int):
        self.ratio, self.intervals = ratio, intervals
        self.streak: dict[int, int] = {}
        self.reported: set[int] = set()
        self.work: list[int] | None = None
        """Micro-batches each rank runs per step, when they differ (a global batch split unevenly over the
        ranks, trainapp/core/layout.py): ranks are compared per micro-batch then, so the rank with one
        more by design is no straggler."""

    def update(self, step: int, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The `straggler` records this interval gives (usually none)."""
        if len(ranks) < 2:
            return []
        if self.work and len(set(self.work)) > 1 and len(self.work) == len(ranks):
            ranks = [{**r, "busy_ms": r["busy_ms"] / self.work[r["rank"]],
                      "phase_ms": {p: v / self.work[r["rank"]] for p, v in r["phase_ms"].items()}}
                     for r in ranks]
        median = statistics.median(r["busy_ms"] for r in ranks)
        found = []
        for r in ranks:
            rank = r["rank"]
            if median <= 0 or r["busy_ms"] <= self.ratio * median:
                self.streak[rank] = 0
                self.reported.discard(rank)
                continue
            self.streak[rank] = self.streak.get(rank, 0) + 1
            if self.streak[rank] >= self.intervals and rank not in self.reported:
                self.reported.add(rank)
                found.append(self._record(step, r, ranks, median))
        return found

    def _record(self, step: int, r: dict[str, Any], ranks: list[dict[str, Any]],
                median: float) -> dict[str, Any]:
        medians = {p: statistics.median(x["phase_ms"][p] for x in ranks) for p in BUSY}
        phase = max(BUSY, key=lambda p: r["phase_ms"][p] - medians[p])
        return {"step": step, "rank": r["rank"], "host": r["host"], "ratio": round(r["busy_ms"] / median, 3),
                "busy_ms": r["busy_ms"], "median_busy_ms": round(median, 3), "phase": phase,
                "phase_ms": r["phase_ms"][phase], "median_phase_ms": round(medians[phase], 3),
                "intervals": self.streak[r["rank"]]}


def straggler_line(s: dict[str, Any], ratio: float) -> str:
    return (f"straggler: rank {s['rank']} on {s['host']} took {s['ratio']:.2f}x the median step time without "
            f"communication wait for {s['intervals']} log intervals (observe.straggler_ratio={ratio:g}); "
            f"slowest phase {s['phase']}: {s['phase_ms']:.1f} ms per step against a median "
            f"{s['median_phase_ms']:.1f} ms")
