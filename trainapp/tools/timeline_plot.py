"""The report's wall-clock timeline (issue 40): one bar per attempt, from its launch to its last record, in
seconds since the run's first launch, so lost time takes the room it took. On each bar: start-up, the
steps a later attempt trained again, a failure's detection (a hang's watchdog timeout, a dead peer
noticed), a preemption's, stop's or resize's notice, snapshots and failures; a dashed line where each
later attempt launched (red: the same job's restart, grey: a new job's); the time between attempts is a
gap.

The attempts' spans come from the run's goodput account (trainapp/observe/goodput.py); the marks from
the attempt's own records. Drawn by trainapp/tools/report.py, which owns matplotlib's import.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from trainapp.observe import goodput

if TYPE_CHECKING:  # matplotlib is imported by report.py, an optional extra
    from matplotlib.axes import Axes
    from matplotlib.container import BarContainer

LABEL = "timeline"
"""The timeline Axes' label (`Axes.get_label()`): how a test or a tool finds the panel in the figure."""

NOTICES = ("preempted", "stopped", "resized")

ENDED = MappingProxyType({"failure": "failed", "notice": "stopped on notice", "end": "finished",
                         "": "records stop"})
"""How an attempt ended (the account's `ended_by`), as its bar's note says it."""

COLOURS = MappingProxyType({"steps": "tab:green", "startup": "silver", "redone": "tab:orange",
                           "hang": "tab:red", "failure detection": "darkred", "notice": "tab:purple",
                           "restart": "tab:red", "relaunch": "tab:gray"})


def _clock(recs: list[dict[str, Any]], start_step: int) -> tuple[list[int], list[float], float]:
    """(steps, when each ended, seconds per step) of one attempt from its `train` records; the first point
    is when its first step began. No points for an attempt that trained no step."""
    gb = recs[0].get("global_batch") or 0
    steps: list[int] = []
    times: list[float] = []
    per = 0.0
    for r in recs:
        if r.get("kind") != "train" or not r.get("samples_per_s"):
            continue
        per = gb / r["samples_per_s"]
        if not steps:
            steps, times = [start_step], [r["time"] - (r["step"] - start_step) * per]
        steps.append(r["step"])
        times.append(r["time"])
    return steps, times, per


def _at(step: int, steps: list[int], times: list[float], per: float) -> float:
    """When `step` ended: between logged steps at the pace between them, after the last at `per` a step
    (the records come every train.log_every steps; a failure's step can be past the last)."""
    if step >= steps[-1]:
        return times[-1] + (step - steps[-1]) * per
    for (s0, t0), (s1, t1) in zip(zip(steps, times), zip(steps[1:], times[1:])):
        if s0 <= step <= s1:
            return t0 + (t1 - t0) * (step - s0) / (s1 - s0) if s1 > s0 else t1
    return times[0]


def spans(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per attempt, in unix seconds: its span (from the account), and the stretches and moments the
    timeline marks on it."""
    acc = goodput.account(records)
    assert acc is not None  # a report is made of a run with a `start` record only (report.read)
    groups = goodput.split(records)  # the attempts' records as the account cut them
    out = []
    for a, prev, recs, nxt in zip(acc["attempts"], [None, *groups], groups, [*groups[1:], None]):
        steps, times, per = _clock(recs, a["start_step"])
        first = times[0] if steps else a["end"]
        # The account's own test of a restart (the same job again) versus a new launch, so that the picture
        # and the badput table (`restart` or `between_attempts`) call the same gap the same.
        restart = prev is not None and goodput.same_job(prev[0], recs[0])
        s = {**a, "restart": restart, "startup": (a["launch"], first), "redone": None, "detection": None,
             "notice": None,
             "snapshots": [r["time"] for r in recs if r.get("kind") == "snapshot"],
             # The first rank to notice: a SIGKILLed rank writes nothing, its peers' records are all there is.
             "failures": [r["time"] for r in recs if r.get("kind") == "failure"][:1],
             "notices": [(r["time"], r["kind"]) for r in recs if r.get("kind") in NOTICES]}
        if steps:
            reached = _at(a["last_step"], steps, times, per)
            resumed = (nxt[0].get("resumed_step") or 0) if nxt else None
            if resumed is not None and a["last_step"] > max(resumed, a["start_step"]):
                s["redone"] = (_at(max(resumed, a["start_step"]), steps, times, per), reached)
            fails = [r for r in recs if r.get("kind") == "failure"]
            if fails:
                cause = "hang" if any(f.get("cause") == "hang" for f in fails) else "failure detection"
                s["detection"] = (reached, min(f["time"] for f in fails), cause)
            elif s["notices"]:
                s["notice"] = (reached, s["notices"][0][0])
        out.append(s)
    return out


class _Legend:
    """Labels each kind of mark once, on its first drawing."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, label: str) -> str | None:
        if label in self.seen:
            return None
        self.seen.add(label)
        return label


def _stretch(ax: Axes, row: int, t: tuple[float, float], t0: float, colour: str, label: str | None,
             **kw: Any) -> None:
    if t[1] > t[0]:
        ax.broken_barh([(t[0] - t0, t[1] - t[0])], (row - 0.3, 0.6), facecolors=colour, label=label, **kw)


def _marks(ax: Axes, row: int, s: dict[str, Any], t0: float, name: _Legend) -> None:
    """One attempt's stretches and moments, over its bar."""
    _stretch(ax, row, s["startup"], t0, COLOURS["startup"], name("start-up"))
    if s["redone"]:
        _stretch(ax, row, s["redone"], t0, COLOURS["redone"], name("steps redone later"), hatch="//",
                 edgecolor="white")
    if s["detection"]:
        begin, end, cause = s["detection"]
        label = "hang (last step to its detection)" if cause == "hang" else "failure detection (dead peer)"
        _stretch(ax, row, (begin, end), t0, COLOURS[cause], name(label))
    if s["notice"]:
        _stretch(ax, row, s["notice"], t0, COLOURS["notice"], name("notice (agreed stop, its snapshot)"))
    if s["snapshots"]:
        ax.plot([t - t0 for t in s["snapshots"]], [row] * len(s["snapshots"]), linestyle="none", marker="|",
                markersize=14, markeredgewidth=1.5, color="black", label=name("snapshot"))
    if s["failures"]:
        ax.plot([t - t0 for t in s["failures"]], [row] * len(s["failures"]), linestyle="none", marker="X",
                markersize=8, color="black", label=name("failure noticed"))
    for t, kind in s["notices"]:
        ax.plot([t - t0], [row], linestyle="none", marker="v", markersize=9, color=COLOURS["notice"],
                label=name("preempted / stopped / resized"))
        ax.annotate(kind, (t - t0, row - 0.3), textcoords="offset points", xytext=(0, 3), ha="center",
                    fontsize="x-small", color=COLOURS["notice"])


def draw(ax: Axes, records: list[dict[str, Any]]) -> BarContainer:
    """The timeline on `ax`, labelled LABEL; returns the attempts' bars (a BarContainer, one per attempt)."""
    ss = spans(records)
    t0 = ss[0]["launch"]
    name = _Legend()
    rows = list(range(len(ss)))
    bars = ax.barh(rows, [s["end"] - s["launch"] for s in ss], left=[s["launch"] - t0 for s in ss],
                   height=0.6, color=COLOURS["steps"], alpha=0.8, label="attempt (training, the rest)")
    for row, s in zip(rows, ss):
        _marks(ax, row, s, t0, name)
        ax.annotate(f"steps {s['start_step']}-{s['last_step']}, {ENDED.get(s['ended_by'], s['ended_by'])}",
                    (s["end"] - t0, row), textcoords="offset points", xytext=(4, 0), va="center",
                    fontsize="x-small")
    for prev, s in zip(ss, ss[1:]):
        ax.axvline(s["launch"] - t0, color=COLOURS["restart" if s["restart"] else "relaunch"], linestyle="--",
                   linewidth=1,
                   label=name("restart (the same job)" if s["restart"] else "relaunch (a new job)"))
        gap = s["launch"] - prev["end"]
        if gap >= 0.02 * (ss[-1]["end"] - t0):  # a restart's second needs no words; a requeue's wait does
            ax.annotate(f"{gap:.0f} s\n" + ("restarting" if s["restart"] else "nothing ran"),
                        ((prev["end"] + s["launch"]) / 2 - t0, s["index"] - 0.5), ha="center", va="center",
                        fontsize="x-small", color="gray")
    ax.set_yticks(rows, [f"attempt {r}" for r in rows])
    ax.set_ylim(len(ss) - 0.4, -0.6)  # attempt 0 on top
    ax.set_xlim(0, (ss[-1]["end"] - t0) * 1.12)  # room for the last bar's note
    ax.set_xlabel("seconds since the run's first launch (wall clock, every attempt)")
    ax.grid(alpha=0.3, axis="x")
    # Above the panel, out of the bars' way.
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.02), ncol=4, fontsize="x-small")
    ax.set_label(LABEL)
    return bars
