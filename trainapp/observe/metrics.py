"""metrics.jsonl: the writer (rank 0 appends one JSON record per line; any rank its `failure`), the one
reader, and the throughput meter behind every `samples_per_s`.

Standard library only: scripts/smoke_assert.py imports this module with a bare python3, beside the
report, the benchmarks and the tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TextIO

METRICS = "metrics.jsonl"


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl (rank 0 only, `path` None elsewhere; restarts
    append). The file opens at the first record and writes nothing once closed. `fence` is called
    before every record and raises when this run may not write any more (its lease was taken over)."""

    def __init__(self, path: Path | None, fence: Callable[[str], None] | None = None):
        self.path, self.fence = path, fence
        self._f: TextIO | None = None

    def write(self, kind: str, **fields: Any) -> None:
        if self.fence is not None and self.path is not None:
            self.fence("record")
        if self._f is None and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", buffering=1)
        if self._f is not None:
            self._f.write(_line(kind, fields))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        self._f, self.path = None, None


def _line(kind: str, fields: dict[str, Any]) -> str:
    return json.dumps({"kind": kind, "time": round(time.time(), 3), "pid": os.getpid(), **fields}) + "\n"


def append(run_dir: str | Path, kind: str, **fields: Any) -> None:
    """One record from any rank, any thread: a single O_APPEND write of one line, which lands whole
    between rank 0's lines (a `failure` record; rank 0's other records go through MetricsWriter)."""
    path = Path(run_dir) / METRICS
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, _line(kind, fields).encode())
    finally:
        os.close(fd)


def parse(lines: Iterable[str]) -> list[dict[str, Any]]:
    """Records from metrics.jsonl lines. A line that is not a whole JSON object is skipped: a writer
    killed mid-line leaves a torn last line, and a reader polling a live run can catch one."""
    records = []
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read(run_dir: str | Path, kind: str | None = None, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl, oldest first, only those of `kind` if given.
    FileNotFoundError when there is no such file, unless `missing_ok` (a run that has not started yet:
    no records)."""
    try:
        with open(Path(run_dir) / METRICS) as f:
            records = parse(f)
    except FileNotFoundError:
        if missing_ok:
            return []
        raise
    return [r for r in records if kind is None or r.get("kind") == kind]


def val_metrics(record: dict[str, Any]) -> dict[str, Any]:
    """The task's evaluation metrics in a record or summary (`val_acc`, `val_loss`, ...; every
    `val_<name>` of the `eval` record but `val_count`, the count they are divided by)."""
    return {k: v for k, v in record.items() if k.startswith("val_") and k != "val_count"}


class Throughput:
    """Samples per second of training alone: evaluation and snapshots run inside `paused()` and are
    not counted. `interval()` is the rate since its last call (a `train` record's), `overall()` the
    rate over this process's run (a snapshot report's and the summary's)."""

    def __init__(self, samples_per_step: int):
        self.samples_per_step = samples_per_step
        self._since = time.perf_counter()
        self._interval_s = self._total_s = 0.0
        self._interval_steps = self._total_steps = 0

    def step(self) -> None:
        self._interval_steps += 1
        self._total_steps += 1

    def _clock(self) -> None:
        now = time.perf_counter()
        self._interval_s += now - self._since
        self._total_s += now - self._since
        self._since = now

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._clock()
        try:
            yield
        finally:
            self._since = time.perf_counter()

    def interval(self) -> float:
        self._clock()
        rate = self._interval_steps * self.samples_per_step / max(self._interval_s, 1e-9)
        self._interval_s, self._interval_steps = 0.0, 0
        return rate

    def overall(self) -> float:
        self._clock()
        return self._total_steps * self.samples_per_step / self._total_s if self._total_s > 0 else 0.0
