"""Where a pytest tier's time goes: the seconds of each test file (setup, call and teardown together) and of
each lane (pytest-xdist's gwN, or `main` without lanes), printed at the end of the session. A lane that
ends long before the other is time the tier could save by ordering or splitting files; the longest file
of the last lane to end is its critical path (docs/testing.md)."""

from __future__ import annotations

from collections import Counter

import pytest


class Lanes:
    """Registered in the process that hands tests out (or the only one): it sees every lane's reports."""

    def __init__(self) -> None:
        self.files: Counter[tuple[str, str]] = Counter()
        """Seconds per (test file, lane)."""

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        node = getattr(report, "node", None)  # xdist's worker, on reports that came from a lane
        lane = node.gateway.id if node is not None else "main"
        self.files[(report.nodeid.split("::")[0], lane)] += report.duration

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.files:
            return
        lanes: Counter[str] = Counter()
        for (_, lane), s in self.files.items():
            lanes[lane] += s
        tr = terminalreporter
        tr.write_sep("=", "seconds per lane, and the 10 longest test files (lane)")
        tr.write_line("   ".join(f"{lane} {s:.0f} s" for lane, s in sorted(lanes.items())))
        for (name, lane), s in self.files.most_common(10):
            tr.write_line(f"{s:8.1f}s  {name} ({lane})")
