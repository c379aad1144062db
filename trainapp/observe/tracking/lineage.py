"""Which values of metrics.jsonl a tracker gets: one per step and metric, the ones the final model
descends from.

An attempt that resumed from the snapshot of step R trains steps R+1... again, so every value an earlier
attempt logged for a step after R is not the run's: it is dropped, and the new attempt's value is the
one kept. Read in file order, each attempt's values are therefore final up to the lowest resume point
of the attempts after it; the running attempt's values are final once a snapshot covering their step is
published (nothing can redo them), or when the run ends. `Reader` applies exactly that, record by
record, holding only values not yet sent.

Standard library only, like trainapp/observe/metrics.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from trainapp.observe.metrics import METRICS, parse, val_metrics

TRAIN_KEYS = ("loss", "lr", "samples_per_s", "loss_scale", "skipped_steps", "world_size", "epoch")
"""What a `train` record gives a tracker (every log interval)."""
END_KEYS = ("goodput", "wall_s", "steps_redone")
"""What the `end` record gives, at the run's last step, with `badput_s/<cause>` for each cause."""

if TYPE_CHECKING:
    Row = dict[str, tuple[float, int]]
    """metric -> (value, the record's time in ms): what one step gives a tracker."""


def _number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def values(record: dict[str, Any]) -> tuple[int, Row] | None:
    """(step, row) of the metrics a record gives a tracker, or None for a record that gives none."""
    kind, ms = record.get("kind"), int(record.get("time", 0) * 1000)
    if kind == "train":
        picked = {k: record.get(k) for k in TRAIN_KEYS}
        step = record.get("step")
    elif kind == "eval":
        picked, step = val_metrics(record), record.get("step")
    elif kind == "end":
        picked = {k: record.get(k) for k in END_KEYS}
        picked.update({f"badput_s/{k}": v for k, v in (record.get("badput_s") or {}).items()})
        step = record.get("steps")
    else:
        return None
    row = {k: (float(v), ms) for k, v in picked.items() if _number(v)}
    return (step, row) if isinstance(step, int) and row else None


def start_points(path: Path) -> list[tuple[int, int]]:
    """(byte offset, resumed step: 0 for a fresh start) of every `start` record in metrics.jsonl."""
    out, offset = [], 0
    try:
        with open(path, "rb") as f:
            for line in f:
                if b'"kind": "start"' in line[:40]:
                    record = parse([line.decode(errors="replace")])
                    if record:
                        out.append((offset, record[0].get("resumed_step") or 0))
                offset += len(line)
    except FileNotFoundError:
        pass
    return out


@dataclass
class Reader:
    """Reads a run's metrics.jsonl from where it left off and keeps the values a tracker still needs.

    `sent`: the last step the tracker holds (rows at or before it are skipped). `limit`: rows held at
    most; reading pauses there until some are sent, so memory stays bounded when a tracker is away for
    long (the rest waits in the file)."""

    run_dir: Path
    sent: int = -1
    limit: int = 10_000
    offset: int = 0
    final: float = -1
    """The running attempt's rows up to this step are final (its resume point, a snapshot it published,
    math.inf once it ended); an earlier attempt's rows are final as they are read."""
    pending: dict[int, Row] = field(default_factory=dict)
    starts: list[dict[str, Any]] = field(default_factory=list)
    """The `start` records read so far (their config, config changes, world size)."""
    ended: bool = False
    _bounds: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # How far each attempt's values stand: the lowest resume point of the attempts after it. The
        # running (last) attempt's values are final up to its own resume point, then as it publishes.
        points = start_points(self.run_dir / METRICS)
        self._bounds = [(off, min((r for _, r in points[i + 1:]), default=math.inf))  # type: ignore[misc]
                        for i, (off, _) in enumerate(points)]
        if points:
            self.final = max(self.final, points[-1][1])

    def _bound(self, offset: int) -> float:
        bound: float = math.inf
        for off, b in self._bounds:
            if off <= offset:
                bound = b
        return bound

    def read(self) -> None:
        """Reads whole lines from `offset` until the end of the file or `limit` pending rows."""
        try:
            f = open(self.run_dir / METRICS, "rb")
        except FileNotFoundError:
            return
        with f:
            f.seek(self.offset)
            while len(self.pending) < self.limit:
                line = f.readline()
                if not line.endswith(b"\n"):
                    break  # the end, or a line still being written
                here, self.offset = self.offset, self.offset + len(line)
                for record in parse([line.decode(errors="replace")]):
                    self._add(here, record)

    def _add(self, offset: int, record: dict[str, Any]) -> None:
        kind, bound = record.get("kind"), self._bound(offset)
        if kind == "start":
            self.starts.append(record)
            return
        if kind == "end" and bound == math.inf:  # the last attempt ended: nothing is redone any more
            self.ended, self.final = True, math.inf
        got = values(record)
        if got is None:
            return
        step, row = got
        if self.sent < step <= bound:  # else the tracker has it, or a later attempt trained it again
            self.pending.setdefault(step, {}).update(row)

    def release(self, step: int | float) -> None:
        """Rows up to `step` are final: a snapshot of it is published (math.inf: the run ended)."""
        self.final = max(self.final, step)

    def ready(self) -> list[tuple[int, Row]]:
        """The final rows not yet sent, oldest step first. The row of the newest final step waits until the
        next one is final or the run ends: records of that step can still come (the `end` record's come
        after the last snapshot), and a tracker's mark says only how far its steps go."""
        return sorted((s, r) for s, r in self.pending.items() if s < self.final)

    def sent_through(self, step: int) -> None:
        """The tracker took every row up to `step`."""
        self.sent = max(self.sent, step)
        for s in [s for s in self.pending if s <= step]:
            del self.pending[s]

    def unsent(self) -> tuple[int, int] | None:
        """(first, last) step of the rows not yet sent, read or still in the file; None when none."""
        self.read()
        if not self.pending:
            return None
        return min(self.pending), max(self.pending)


def params(config: dict[str, Any], limit: int = 6000) -> dict[str, str]:
    """The resolved config as tracker params: `section.key` -> its value as text (at most `limit`
    characters, MLflow's cap)."""
    from trainapp.config.changes import flat

    out = {}
    for k, v in flat(config).items():
        text = v if isinstance(v, str) else json.dumps(v, default=str)
        out[k] = text if len(text) <= limit else text[: limit - 1] + "…"
    return out


def chunks(rows: list[tuple[int, Row]], most: int) -> Iterator[list[tuple[int, Row]]]:
    """Whole steps, at most `most` values a chunk (one step with more is a chunk alone)."""
    chunk: list[tuple[int, Row]] = []
    size = 0
    for step, row in rows:
        if chunk and size + len(row) > most:
            yield chunk
            chunk, size = [], 0
        chunk.append((step, row))
        size += len(row)
    if chunk:
        yield chunk
