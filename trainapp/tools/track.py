"""`trainapp track RUN_DIR`: hands a run's trackers (its config's `observe.mlflow_uri`,
`observe.wandb_project`) what they have not taken yet, from metrics.jsonl: after a run whose tracker was
away at its end, or to catch up a run that stopped. The same sender as the run's own
(trainapp/observe/tracking/), so the same rules hold: the same tracker run, each step once, the final
values only; a run that ended is closed with its report and model, one that stopped is left open for its
next attempt. Sending again what a tracker holds sends nothing."""

from __future__ import annotations

from pathlib import Path

from trainapp.config import ConfigError, from_dict
from trainapp.observe import metrics, tracking


def run(run_dir: str, wait_s: float) -> tuple[list[str], bool]:
    """(one line per tracker, whether every one took everything)."""
    root = Path(run_dir)
    records = metrics.read(root, missing_ok=True)
    starts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
    if not starts:
        raise ConfigError(f"{root}: no `start` record in {root / metrics.METRICS}; pass a run.dir")
    last = records[starts[-1]:]
    cfg = from_dict(last[0]["config"])
    tracking.check(cfg.observe)
    senders = tracking.senders(cfg.observe, root, last[0].get("launcher", "alone"))
    if not senders:
        raise ConfigError(f"{root}: its config sets no tracker (observe.mlflow_uri, observe.wandb_project)")
    ended = any(r.get("kind") == "end" for r in last)
    # What the last attempt published, as far as its records say (its snapshots, or its stop's).
    newest = max((r["step"] for r in last if r.get("kind") == "snapshot"), default=None)
    lines, whole = [], True
    model = str(root / "model") if ended and (root / "model").is_dir() else None
    for s in senders:
        s.published = lambda: newest
        s.start()
        s.finish("FINISHED" if ended else "KILLED", wait_s, model)
        whole &= s.closed
        state = "closed" if ended else "left open for the run's next attempt"
        lines.append(f"track: {s.sink.where}: {s.sent_values} values sent; its run {state}" if s.closed
                     else f"track: {s.sink.where}: not every value taken within {wait_s:g} s")
    return lines, whole
