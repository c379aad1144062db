"""`python -m trainapp report RUN_DIR`: plots and a short summary of a run, from its metrics.jsonl.

One PNG (`RUN_DIR/report.png`, or `--out`): the wall-clock timeline of the run's attempts (trainapp/tools/
timeline_plot.py); loss, validation accuracy, samples/s, learning rate, the fp16 loss scale and every
rank's step time over optimizer steps, each restart marked where it resumed and each failure where it
happened; each rank's step split into phases. A panel without data in the run is left out. The summary
(with one line per failed attempt: which rank, where, why, the slowest rank and phase, any straggler)
is printed and written beside it as `report.txt`. Works on `run.dir` of torchrun runs and on
`STORAGE/NAME` of Ray runs. matplotlib is an optional extra: `pip install 'trainapp[report]'`.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence

from trainapp.config import ConfigError, changes
from trainapp.faults.heartbeat import PEER_WAIT_PHASES
from trainapp.observe import goodput, metrics
from trainapp.snapshots.lease import describe
from trainapp.tools import timeline_plot

if TYPE_CHECKING:  # matplotlib is an optional extra, imported by `_pyplot`
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def read(run_dir: Path) -> list[dict[str, Any]]:
    try:
        records = metrics.read(run_dir)
    except FileNotFoundError:
        raise ConfigError(f"{run_dir}: no {metrics.METRICS} here; pass a run.dir (or STORAGE/NAME of a Ray "
                          "run)") from None
    if not any(r.get("kind") == "start" for r in records):
        raise ConfigError(f"{run_dir / metrics.METRICS}: no `start` record; is this a trainapp run?")
    return records


REACHED = ("train", "failure", "preempted", "stopped", "resized")
"""Records that say a step reached: `train` every train.log_every steps, and how an attempt ended."""


def restarts(records: list[dict]) -> list[dict]:
    """One entry per start after the first: where it resumed and how many steps were done twice."""
    out, highest = [], 0
    starts = 0
    for r in records:
        kind = r.get("kind")
        if kind in REACHED and isinstance(r.get("step"), int):
            highest = max(highest, r["step"])
        elif kind == "start":
            starts += 1
            if starts > 1:
                resumed = r.get("resumed_step") or 0
                out.append({"resumed_step": resumed, "trained_to": highest,
                            "redone": max(0, highest - resumed), "world_size": r.get("world_size"),
                            "tier": r.get("resumed_tier") or "storage"})
    return out


def _root_cause_first(f: dict) -> tuple:
    # A peer's record follows another's failure; a rank found hung in forward and backward is most often
    # waiting in the gradient all-reduce for the rank that hung elsewhere (data, eval, its write).
    waiting = f.get("cause") == "hang" and f.get("phase") in PEER_WAIT_PHASES
    return f.get("cause") == "peer", waiting, f["time"]


def failures(records: list[dict]) -> list[str]:
    """One line per attempt that ended early: its ranks' `failure` records, root cause first, or, with
    none, what Ray Train's controller saw (a `group_failure` record) or that it ended without a word
    (a SIGKILL: a lost node, the OOM killer)."""
    starts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
    fails = [r for r in records if r.get("kind") == "failure"]
    out = []
    for k, i in enumerate(starts):
        mine = sorted((f for f in fails if f.get("attempt", 0) == k), key=_root_cause_first)
        nxt = starts[k + 1] if k + 1 < len(starts) else len(records)
        ended = {r.get("kind") for r in records[i:nxt]} & {"end", "preempted"}
        # Ray Train's controller's view, for the ranks that said nothing themselves (a SIGKILL).
        seen: dict[str, str] = next((r.get("errors", {}) for r in records[i:nxt]
                                     if r.get("kind") == "group_failure"), {})
        silent = "; ".join(f"rank {rank}: {error}" for rank, error in seen.items()
                           if int(rank) not in {f.get("rank") for f in mine})
        if silent and all(f.get("cause") == "peer" for f in mine):  # the silent rank went first
            also = "; ".join(f"rank {f['rank']} {f['cause']}" for f in mine)
            out.append(f"attempt {k}: Ray Train saw {silent}" + (f"; then {also}" if also else ""))
        elif mine:
            first = mine[0]
            also = "; ".join(f"rank {f['rank']} {f['cause']}" for f in mine[1:])
            out.append(f"attempt {k}: rank {first['rank']} on {first['host']} after step {first['step']} "
                       f"(phase {first['phase']}): {first['cause']}: {first['error']}"
                       + (f"; then {also}" if also else "")
                       + (f"; Ray Train saw {silent}" if silent else ""))
        elif k + 1 < len(starts) and not ended:
            out.append(f"attempt {k}: ended without a failure record (SIGKILL: a lost node, the OOM killer)")
    return out


def rank_phases(records: list[dict]) -> dict[int, dict[str, Any]]:
    """Per rank over the `ranks` records (trainapp/observe/timings.py): its host, the median step time, busy
    time (the step without waiting for peers), process CPU time per step (None in runs that predate
    it) and ms per step of each phase."""
    from trainapp.observe.timings import PHASES

    by_rank: dict[int, list[dict]] = {}
    for r in records:
        if r.get("kind") == "ranks":
            for entry in r.get("ranks", []):
                by_rank.setdefault(entry["rank"], []).append(entry)
    return {rank: {"host": entries[-1].get("host"),
                   "step_ms": statistics.median(e["step_ms"] for e in entries),
                   "busy_ms": statistics.median(e["busy_ms"] for e in entries),
                   "cpu_ms": (statistics.median(cpu)
                              if (cpu := [e["cpu_ms"] for e in entries if "cpu_ms" in e]) else None),
                   "phase_ms": {p: statistics.median(e["phase_ms"].get(p, 0.0) for e in entries)
                                for p in PHASES}}
            for rank, entries in sorted(by_rank.items())}


def _rank_lines(records: list[dict]) -> list[str]:
    from trainapp.observe.timings import BUSY

    ranks = rank_phases(records)
    if not ranks:
        return []
    # Ranks wait for each other, so their step times match: the slowest is the one with the most own work.
    slow_rank, slow = max(ranks.items(), key=lambda kv: kv[1]["busy_ms"])
    fast_rank, fast = min(ranks.items(), key=lambda kv: kv[1]["busy_ms"])
    busy = {p: slow["phase_ms"][p] for p in BUSY}
    phase = max(busy, key=busy.__getitem__)
    lines = [f"ranks          {len(ranks)}; median step {slow['step_ms']:.1f} ms; slowest rank {slow_rank} "
             f"on {slow['host']}: {slow['busy_ms']:.1f} ms of its own work per step, most of it {phase} "
             f"({busy[phase]:.1f} ms)"
             + ("" if slow["cpu_ms"] is None else f", {slow['cpu_ms']:.1f} ms of CPU")
             + ("" if len(ranks) < 2 else f"; fastest rank {fast_rank}: {fast['busy_ms']:.1f} ms")]
    found = [r for r in records if r.get("kind") == "straggler"]
    lines.append(f"stragglers     {len(found) or 'none'}")
    lines.extend(f"  rank {f['rank']} on {f['host']} from step {f['step']}: {f['ratio']:.2f}x the median "
                 f"step without communication wait; {f['phase']} {f['phase_ms']:.1f} ms against "
                 f"{f['median_phase_ms']:.1f} ms"
                 for f in found)
    return lines


def val_keys(records: list[dict]) -> list[str]:
    """The task's evaluation metrics in the eval records (`val_acc`, `val_loss`, ...), in order of first
    appearance, without `val_count`."""
    keys: dict[str, None] = {}
    for r in records:
        if r.get("kind") == "eval":
            keys.update(dict.fromkeys(metrics.val_metrics(r)))
    return list(keys)


def _start_lines(starts: list[dict]) -> list[str]:
    """A line for each attempt that took the run's lease over from another run, or resumed under a
    changed config (docs/run-directory.md)."""
    lines = []
    for i, start in enumerate(starts):
        took = (start.get("lease") or {}).get("took_over")
        if took:
            lines.append(f"take-over      attempt {i} took the run directory over from "
                         f"{describe(took['holder'] or {})}: {took['why']}")
        if start.get("config_changes"):
            lines.append(f"config         attempt {i} resumed with {changes.line(start['config_changes'])}")
        layout, was = start.get("layout") or {}, (start.get("layout") or {}).get("resized_from")
        if was:
            kept = "kept" if was["global_batch"] == layout["global_batch"] else \
                f"{was['global_batch']} -> {layout['global_batch']} (rescaled)"
            lines.append(f"resize         attempt {i} at step {start['step']}: world size "
                         f"{was['world_size']} -> {start['world_size']}, global batch {kept}, "
                         f"micro-batches per rank {layout['micro_steps']}")
    return lines


def summarize(run_dir: Path, records: list[dict]) -> str:
    train = [r for r in records if r.get("kind") == "train"]
    starts = [r for r in records if r.get("kind") == "start"]
    end = next((r for r in reversed(records) if r.get("kind") == "end"), None)
    first = starts[0]
    lines = [f"run            {run_dir}"]
    last = train[-1]["step"] if train else 0
    state = f"finished at step {end['steps']}" if end else f"not finished (last step {last})"
    lines.append(f"status         {state} of {first.get('total_steps')} planned")
    acc = goodput.account(records)
    if acc is not None:
        lines.append(f"wall time      {acc['wall_s']:.1f} s from the first launch to the last record")
    # trainapp's start records all name their world size; with none named, None alone sorts.
    sizes = sorted({s.get("world_size") for s in starts})  # type: ignore[type-var]
    lines.append(f"world size     {', '.join(map(str, sizes))}; amp {first.get('amp')}; "
                 f"backend {first.get('backend')}")
    rs = restarts(records)
    if rs:
        what = "; ".join(f"resumed at {r['resumed_step']} from {r['tier']} after {r['trained_to']} "
                         f"({r['redone']} redone, world size {r['world_size']})" for r in rs)
        lines.append(f"restarts       {len(rs)}: {what}")
    else:
        lines.append("restarts       none")
    lines.extend(_start_lines(starts))
    if acc is not None:
        lines.extend(goodput.table(acc))
    fails = failures(records)
    lines.append(f"failures       {len(fails) or 'none'}")
    lines.extend(f"  {f}" for f in fails)
    lines.extend(_progress_lines(records, train))
    lines.extend(_rank_lines(records))
    network = [n for n in (first.get("network") or []) if n and n.get("gloo")]
    if network:
        lines.append("network        "
                     + ", ".join(f"{n['host']} {n['gloo']} ({n['address']})" for n in network))
    return "\n".join(lines)


def _progress_lines(records: list[dict], train: list[dict]) -> list[str]:
    """The loss, samples/s, every validation metric and the snapshots' cost, over the run."""
    lines = []
    evals = [r for r in records if r.get("kind") == "eval"]
    snaps = [r["blocking_s"] for r in records if r.get("kind") == "snapshot"]
    if train:
        lines.append(f"loss           {train[0]['loss']:.4f} at step {train[0]['step']} -> "
                     f"{train[-1]['loss']:.4f} at step {train[-1]['step']}")
        sps = [r["samples_per_s"] for r in train if r.get("samples_per_s")]
        if sps:
            lines.append(f"samples/s      median {statistics.median(sps):.1f} over {len(sps)} records")
    for key in val_keys(records):
        seen = [r for r in evals if key in r]
        low, high = min(seen, key=lambda r: r[key]), max(seen, key=lambda r: r[key])
        lines.append(f"{key:<14} final {seen[-1][key]:.4f} at step {seen[-1]['step']}; lowest {low[key]:.4f} "
                     f"at step {low['step']}, highest {high[key]:.4f} at step {high['step']}")
    if snaps:
        lines.append(f"snapshots      {len(snaps)} written; training blocked a median "
                     f"{statistics.median(snaps) * 1000:.1f} ms each")
    return lines


def _segments(records: list[dict], kind: str, key: str) -> list[tuple[list[int], list[float]]]:
    """(steps, values) per attempt: a restart starts a new line, so redone steps do not zigzag."""
    segs: list[tuple[list[int], list[float]]] = []
    for r in records:
        if r.get("kind") == "start":
            segs.append(([], []))
        elif r.get("kind") == kind and r.get(key) is not None and segs:
            segs[-1][0].append(r["step"])
            segs[-1][1].append(r[key])
    return [s for s in segs if s[0]]


def _rank_segments(records: list[dict]) -> dict[int, list[tuple[list[int], list[float]]]]:
    """Per rank, (steps, busy ms: the step without waiting for peers) per attempt."""
    out: dict[int, list[tuple[list[int], list[float]]]] = {}
    attempt = -1
    for r in records:
        if r.get("kind") == "start":
            attempt += 1
        elif r.get("kind") == "ranks":
            for e in r.get("ranks", []):
                segs = out.setdefault(e["rank"], [])
                if len(segs) <= attempt:
                    segs.extend(([], []) for _ in range(attempt + 1 - len(segs)))
                segs[attempt][0].append(r["step"])
                segs[attempt][1].append(e["busy_ms"])
    return {rank: [s for s in segs if s[0]] for rank, segs in out.items()}


def _plot_rank_work(ax: Axes, records: list[dict], rs: list[dict]) -> None:
    """Each rank's own work per step over steps, restarts and named stragglers marked."""
    per_rank = _rank_segments(records)
    for rank, segs in sorted(per_rank.items()):
        for i, (xs, ys) in enumerate(segs):
            ax.plot(xs, ys, color=f"C{rank % 10}", linewidth=1.2, label=f"rank {rank}" if i == 0 else None)
    for r in rs:
        ax.axvline(r["resumed_step"], color="tab:red", linestyle="--", linewidth=1)
    for i, s in enumerate(r for r in records if r.get("kind") == "straggler"):
        ax.axvline(s["step"], color=f"C{s['rank'] % 10}", linestyle=":", linewidth=1.5,
                   label="straggler named" if i == 0 else None)
    ax.legend(loc="upper right", fontsize="small", ncol=min(len(per_rank) + 1, 8))
    ax.set_ylabel("own work per step\n(ms, without comm wait)")
    ax.grid(alpha=0.3)


def _plot_phases(ax: Axes, records: list[dict]) -> None:
    """Each rank's median step split into phases: one stacked bar per rank."""
    from trainapp.observe.timings import PHASES

    ranks = rank_phases(records)
    names = [f"rank {r}" for r in ranks]
    left = [0.0] * len(ranks)
    for phase in PHASES:
        widths = [v["phase_ms"][phase] for v in ranks.values()]
        ax.barh(names, widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("median ms per step, by phase")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=len(PHASES), fontsize="small")
    ax.grid(alpha=0.3, axis="x")


def _draw_runs(ax: Axes, records: list[dict], compare: dict[str, list[dict]], kind: str, key: str) -> None:
    """The run's `key` of its `kind` records, and each compared run's dashed over it."""
    segs = _segments(records, kind, key)
    for i, (xs, ys) in enumerate(segs):
        ax.plot(xs, ys, color="tab:blue", marker="." if len(xs) < 50 else None, linewidth=1.2,
                label="this run" if compare and i == 0 else None)
    for n, (other, other_records) in enumerate(compare.items()):
        for i, (xs, ys) in enumerate(_segments(other_records, kind, key)):
            ax.plot(xs, ys, color=f"C{n + 1}", linestyle="--", linewidth=1, label=other if i == 0 else None)


def _step_panels(records: list[dict], compare: dict[str, list[dict]]) -> list[tuple[str, str, str, bool]]:
    """(name, kind, key, log scale) of the panels over steps that have data in this run or a compared one:
    an empty panel (the fp16 loss scale of a bf16 run, evaluation never reached) only takes room."""
    # The task's first evaluation metric: val_acc for the image task, val_loss for char_lm's.
    val = next(iter(val_keys(records)), "val_loss")
    panels = [("loss", "train", "loss", False), (val, "eval", val, False),
              ("samples/s", "train", "samples_per_s", False), ("learning rate", "train", "lr", False),
              ("loss scale (fp16)", "train", "loss_scale", True)]
    return [p for p in panels if any(_segments(rs, p[1], p[2]) for rs in (records, *compare.values()))]


def _plot_steps(ax: Axes, records: list[dict], compare: dict[str, list[dict]],
                panel: tuple[str, str, str, bool], marks: tuple[list[dict], list[dict]]) -> None:
    """One panel over steps: the runs' curves, restarts where they resumed, failures where they happened."""
    name, kind, key, log_scale = panel
    _draw_runs(ax, records, compare, kind, key)
    if log_scale:
        ax.set_yscale("log", base=2)
    rs, fails = marks
    for i, r in enumerate(rs):
        ax.axvline(r["resumed_step"], color="tab:red", linestyle="--", linewidth=1,
                   label="restart (resumed here)" if i == 0 else None)
    for i, f in enumerate(fails):
        ax.axvline(f["step"], color="black", linestyle=":", linewidth=1,
                   label="failure (see report.txt)" if i == 0 else None)
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)


def _pyplot() -> ModuleType:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("matplotlib is not installed (the report extra): "
                          "pip install 'trainapp[report]'") from None
    return plt


def figure(records: list[dict], title: str, compare: dict[str, list[dict]] | None = None) -> Figure:
    """The report's matplotlib Figure: the wall-clock timeline, then the panels with data: those over
    steps (each run of `compare`, name: its records, drawn over them) and each rank's step in phases."""
    plt = _pyplot()
    compare = compare or {}
    panels = _step_panels(records, compare)
    ranks = bool(rank_phases(records))
    attempts = sum(r.get("kind") == "start" for r in records)
    heights = [1.9 + 0.45 * min(attempts, 8)] + [2.3] * (len(panels) + 2 * ranks)
    # Constrained layout gives each panel the room its own legend and labels take, the title included.
    fig, all_axes = plt.subplots(len(heights), 1, figsize=(9, sum(heights)), height_ratios=heights,
                                 squeeze=False, layout="constrained")
    axes = list(all_axes[:, 0])
    timeline_plot.draw(axes[0], records)
    step_axes = axes[1:len(panels) + 1 + ranks]
    for ax in step_axes[1:]:
        ax.sharex(step_axes[0])
    rs = restarts(records)
    fails = [r for r in records if r.get("kind") == "failure" and r.get("cause") != "peer"]
    for ax, panel in zip(step_axes, panels):
        _plot_steps(ax, records, compare, panel, (rs, fails))
    if ranks:
        _plot_rank_work(axes[-2], records, rs)
        _plot_phases(axes[-1], records)
    if step_axes:
        step_axes[-1].set_xlabel("optimizer step")
    if panels and (rs or fails or compare):
        step_axes[0].legend(loc="upper right", fontsize="small")
    fig.suptitle(title)
    return fig


def plot(records: list[dict], out: Path, title: str, compare: dict[str, list[dict]] | None = None) -> Path:
    """The report's figure (see `figure`) as a PNG at `out`."""
    fig = figure(records, title, compare)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)
    return out


def run(run_dir: str, out: str | None = None, compare: Sequence[str] = ()) -> tuple[Path, str]:
    """`run_dir`'s report.png and report.txt; the runs of `compare` drawn over its step panels (another
    run of the same config: a resized one against a straight one, another policy)."""
    root = Path(run_dir)
    records = read(root)
    png = Path(out) if out else root / "report.png"
    text = summarize(root, records)
    others = {str(Path(c).name): read(Path(c)) for c in compare}
    plot(records, png, f"trainapp run {root.name}", others)
    png.with_suffix(".txt").write_text(text + "\n")
    return png, text
