"""A census of the processes the tests start (`make test PYTEST_ARGS=--census=/tmp/c.json`; then
`PYTHONPATH=. .venv/bin/python tests/census.py /tmp/c*.json` prints the table): every process that
appears under this pytest process (a lane's, under pytest-xdist) while a test file runs, counted per
file and by kind, with the seconds the file took. Most of the suite's time is process start-up (a Python
that imports torch takes seconds on these CPUs), so this names the files where fewer processes would
save the most.

/proc is read every 20 ms from a thread: a process that lives less than that may be missed, and none of
the ones that cost start-up time does. A process counts when its parent chain reaches this pytest process
at the time it is first seen; Ray's workers do (the test's cluster is started from here)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from devtools.local_ray import proc_stat

POLL_S = 0.02


def _parent(pid: int) -> int:
    stat = proc_stat(pid)
    return int(stat[1][1]) if stat else 0


def kind(pid: int) -> str:
    """`python` (an interpreter: trainapp, torchrun, a Ray worker before it renames itself), `ray actor`
    (`ray::...`), `ray daemon` (raylet, gcs_server, ...) or `other` (tc, ip, mount, docker, ...)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "other"  # gone already
    stat = proc_stat(pid)
    exe = os.path.basename(argv[0]) if argv[0] else (stat[0] if stat else "")
    if exe.startswith("ray::"):
        return "ray actor"
    if exe.startswith("python") or (len(argv) > 1 and os.path.basename(argv[1]).startswith("python")):
        return "python"
    if exe in ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor") or "/ray/" in argv[0]:
        return "ray daemon"
    return "other"


class Census:
    def __init__(self, out: Path):
        self.out, self.me = out, os.getpid()
        self.seen = {int(p) for p in os.listdir("/proc") if p.isdigit()}
        self.file = "(collection)"
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.seconds: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, name="census", daemon=True)
        self.thread.start()

    def _mine(self, pid: int) -> bool:
        for _ in range(64):  # a chain longer than this is not the suite's
            pid = _parent(pid)
            if pid == self.me:
                return True
            if pid <= 1:
                return False
        return False

    def _poll(self) -> None:
        while not self.stop.wait(POLL_S):
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in self.seen:
                    continue
                pid = int(name)
                self.seen.add(pid)
                if self._mine(pid):
                    self.counts[self.file][kind(pid)] += 1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        self.file, started = item.path.name, time.monotonic()
        yield
        self.seconds[item.path.name] += time.monotonic() - started

    def pytest_sessionfinish(self, session):
        self.stop.set()
        self.thread.join()
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        out = self.out.with_name(f"{self.out.stem}-{worker}{self.out.suffix}") if worker else self.out
        files = {f: {"seconds": round(self.seconds[f], 1), **self.counts[f]}
                 for f in sorted(set(self.counts) | set(self.seconds))}
        out.write_text(json.dumps(files, indent=1) + "\n")


def merge(paths: list[Path]) -> dict[str, dict[str, float]]:
    """The lanes' censuses as one: per file, the sum of each count (a file runs in one lane)."""
    total: dict[str, Counter] = defaultdict(Counter)
    for path in paths:
        for f, counts in json.loads(path.read_text()).items():
            total[f].update(counts)
    return {f: dict(c) for f, c in sorted(total.items(), key=lambda kv: -kv[1].get("seconds", 0))}


if __name__ == "__main__":
    import sys

    merged = merge([Path(p) for p in sys.argv[1:]])
    kinds = ["python", "ray actor", "ray daemon", "other"]
    print(f"{'file':32} {'seconds':>8} " + " ".join(f"{k:>10}" for k in kinds))
    for f, c in merged.items():
        print(f"{f:32} {c.get('seconds', 0):8.0f} " + " ".join(f"{c.get(k, 0):10.0f}" for k in kinds))
    print(f"{'total':32} {sum(c.get('seconds', 0) for c in merged.values()):8.0f} "
          + " ".join(f"{sum(c.get(k, 0) for c in merged.values()):10.0f}" for k in kinds))
