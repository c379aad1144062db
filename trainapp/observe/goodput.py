"""Where a run's wall time went, across every attempt: an account made from
the records of metrics.jsonl alone, so it works on any run, finished or not, under any launcher.

The run's wall time is from the first attempt's launch (its earliest start-up mark) to the last record.
Each attempt's span, from its launch to its last record, is cut into:

- `startup`: launch to the first optimizer step;
- the steps: every interval of `train` records, its steps times the seconds a step took
  (global batch / samples per second: the meter leaves snapshots and evaluations out); of them,
  `data` (waiting for batches, the median rank's) and `stragglers` (the slowest rank's own work beyond
  the fastest's pace: what the others waited in the all-reduce, less what an uneven split of the
  global batch makes them wait by design) are badput, and so are `redone`: the steps
  trained after the snapshot the next attempt resumed from; the rest is goodput;
- `snapshot` (training blocked by snapshot writes) and `eval`;
- the tail after the last progress: `detection` when the attempt ended in a failure (the last step to
  the first `failure` record: a hang's watchdog timeout, a dead peer noticed), `notice` when it ended on
  a preemption, a stop or a resize (the agreed step and its snapshot);
- `other`: whatever of the span the above do not explain (a few per cent at most; the tests hold it
  under 2 %).

Between attempts: `restart` when the next attempt is the same job's restart (torchrun's restart count
went up, the same job, or the same Ray driver), `between_attempts` otherwise (a resubmission, a Slurm
requeue: time in which nothing of the run ran, waiting in a queue or for capacity).

Standard library only, as metrics.py.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

CAUSES = ("startup", "redone", "data", "stragglers", "snapshot", "eval", "detection", "notice", "restart",
          "between_attempts", "other")
"""Badput causes, in the order the report lists them."""


@dataclass
class Attempt:
    """One attempt's share of the account (seconds, wall clock)."""

    index: int
    launch: float
    end: float
    start_step: int
    last_step: int
    step_s: float = 0.0
    """Mean seconds per step of this attempt (0 when it trained none)."""
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds by cause, and `steps`: the time its steps took."""
    ended_by: str = ""
    """failure, notice (preempted, stopped, resized), end, or '' (the records just stop)."""


def split(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    for r in records:
        if r.get("kind") == "start":
            out.append([r])
        elif out:
            out[-1].append(r)
    return out


def _launch(start: dict[str, Any], not_before: float) -> float:
    marks = [v for v in (start.get("startup") or {}).values() if isinstance(v, (int, float))]
    return max(min(marks + [start["time"]]), not_before)


def _steps(start: dict[str, Any], recs: list[dict[str, Any]]) -> tuple[float, float | None, int, float]:
    """(seconds the steps took, when the first began, the last step reached, when the last ended)."""
    gb, prev, total, first, last_t = start.get("global_batch") or 0, start["step"], 0.0, None, start["time"]
    for r in recs:
        if r.get("kind") != "train" or not r.get("samples_per_s"):
            continue
        n, per = r["step"] - prev, gb / r["samples_per_s"]
        if first is None:
            first = r["time"] - n * per
        total, prev, last_t = total + n * per, r["step"], r["time"]
    return total, first, prev, last_t


def _straggling_ms(ranks: list[dict[str, Any]], work: list[int] | None) -> float:
    """Per step, how much longer the slowest rank's own work took than if every rank worked at the
    fastest one's pace per micro-batch. A global batch split unevenly (trainapp/core/layout.py) gives
    some ranks a micro-batch more by design: that wait is the split's, not a straggler's."""
    if not work or len(work) != len(ranks):
        work = [1] * len(ranks)
    busy = [x["busy_ms"] for x in ranks]
    pace = min(b / max(w, 1) for b, w in zip(busy, work))
    return max(0.0, max(busy) - pace * max(work))


def _waits(start: dict[str, Any], recs: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(data, stragglers, eval) seconds from the `ranks` records."""
    data = stragglers = evals = 0.0
    work = (start.get("layout") or {}).get("micro_steps")
    for r in recs:
        ranks = r.get("ranks") if r.get("kind") == "ranks" else None
        if not ranks:
            continue
        n = ranks[0].get("steps", 0)
        data += statistics.median(x["phase_ms"].get("data", 0.0) for x in ranks) * n / 1000
        evals += statistics.median(x["phase_ms"].get("eval", 0.0) for x in ranks) * n / 1000
        stragglers += _straggling_ms(ranks, work) * n / 1000
    return data, stragglers, evals


def _attempt(i: int, recs: list[dict[str, Any]], not_before: float) -> Attempt:
    start = recs[0]
    launch = _launch(start, not_before)
    steps_s, first, last_step, last_t = _steps(start, recs)
    a = Attempt(i, launch, max(r["time"] for r in recs), start["step"], last_step)
    trained = last_step - start["step"]
    a.step_s = steps_s / trained if trained else 0.0
    fail = next((r for r in recs if r.get("kind") == "failure"), None)
    notice = next((r for r in recs if r.get("kind") in ("preempted", "stopped", "resized")), None)
    # Steps after the last train record (the records come every train.log_every steps): the failure or
    # notice says the step reached.
    reached = max([last_step] + [r["step"] for r in (fail, notice) if r and isinstance(r.get("step"), int)])
    steps_s += (reached - last_step) * a.step_s
    last_t += (reached - last_step) * a.step_s
    a.last_step = reached
    data, stragglers, evals = _waits(start, recs)
    snap = sum(r.get("blocking_s", 0.0) for r in recs if r.get("kind") == "snapshot")
    a.parts = {"startup": (first if first is not None else a.end) - launch, "steps": steps_s, "data": data,
               "stragglers": stragglers, "snapshot": snap, "eval": evals}
    if fail is not None:
        a.ended_by, a.parts["detection"] = "failure", max(0.0, fail["time"] - last_t)
    elif notice is not None:
        a.ended_by, a.parts["notice"] = "notice", max(0.0, notice["time"] - last_t)
    elif any(r.get("kind") == "end" for r in recs):
        a.ended_by = "end"
    return a


def same_job(prev: dict[str, Any], nxt: dict[str, Any]) -> bool:
    """The next attempt is the same launch's restart: torchrun's restart count went up, the lease names
    the same job (torchrun's run id, a Slurm job not requeued in between: a requeue keeps the job's id,
    its `requeue` count tells it, and its queue wait is time between attempts), or the same Ray driver
    started both."""
    if (nxt.get("restart") or 0) > (prev.get("restart") or 0):
        return True
    holders = [((s.get("lease") or {}).get("holder") or {}) for s in (prev, nxt)]
    jobs = [h.get("job") for h in holders]
    if jobs[0] and jobs[0] == jobs[1] and not jobs[0].startswith("alone"):
        return holders[0].get("requeue") == holders[1].get("requeue")
    driver = [(s.get("startup") or {}).get("driver_process") for s in (prev, nxt)]
    return driver[0] is not None and driver[0] == driver[1]


def account(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's account (seconds and shares), or None for records without a `start`."""
    groups = split(records)
    if not groups:
        return None
    attempts: list[Attempt] = []
    for i, recs in enumerate(groups):
        attempts.append(_attempt(i, recs, attempts[-1].end if attempts else float("-inf")))
    bad = dict.fromkeys(CAUSES, 0.0)
    good = redone_steps = 0.0
    for a, nxt, start, nstart in zip(attempts, attempts[1:] + [None], groups, groups[1:] + [None]):
        # The steps this attempt trained after the snapshot the next one resumed from (none: from scratch).
        redone = min(a.last_step - a.start_step, max(0, a.last_step - (nstart[0].get("resumed_step") or 0))) \
            if nxt and nstart is not None else 0
        redone_steps += redone
        p = a.parts
        steps_bad = p["data"] + p["stragglers"] + redone * a.step_s
        good += max(0.0, p["steps"] - steps_bad)
        for cause in ("startup", "data", "stragglers", "snapshot", "eval", "detection", "notice"):
            bad[cause] += p.get(cause, 0.0)
        bad["redone"] += redone * a.step_s
        explained = (p["startup"] + p["steps"] + p["snapshot"] + p["eval"] + p.get("detection", 0)
                     + p.get("notice", 0))
        bad["other"] += (a.end - a.launch) - explained
        if nxt is not None and nstart is not None:
            bad["restart" if same_job(start[0], nstart[0])
                else "between_attempts"] += max(0.0, nxt.launch - a.end)
    wall = attempts[-1].end - attempts[0].launch
    return {"wall_s": wall, "goodput_s": good, "goodput": good / wall if wall > 0 else 0.0,
            "badput_s": {k: round(v, 3) for k, v in bad.items()}, "steps_redone": int(redone_steps),
            "attempts": [{"index": a.index, "launch": a.launch, "end": a.end, "start_step": a.start_step,
                          "last_step": a.last_step, "ended_by": a.ended_by} for a in attempts]}


def table(acc: dict[str, Any]) -> list[str]:
    """The account as report lines: goodput, then each cause with seconds and share of the wall time."""
    wall = acc["wall_s"] or 1.0
    lines = [f"goodput        {acc['goodput']:.1%} of {acc['wall_s']:.1f} s ({acc['goodput_s']:.1f} s in "
             f"steps the final model kept; {acc['steps_redone']} steps redone)"]
    for cause in CAUSES:
        s = acc["badput_s"].get(cause, 0.0)
        if abs(s) >= 0.05:
            lines.append(f"  {cause:<16} {s:8.1f} s  {s / wall:6.1%}")
    return lines
