"""The Ray driver's terminal while a run starts: Ray's forwarded output is held back until the run has
trained its first step, so that a run that cannot start ends with trainapp's one line, not with Ray's.

With `log_to_driver`, Ray prints in the driver every line the cluster's processes write: the training
workers', Ray Train's controller's, and its own daemons' (the GCS's actor scheduler, a worker's gRPC
server, the raylet's). When a run fails to start on bad input (a task argument the workers reject, a
snapshot that does not fit), that is a worker's traceback, the controller's account of it with the same
traceback, a placement-group cleaner's traceback, and native error lines from the daemons: around a
hundred lines before trainapp's one line, and, worse for a script reading the job's output, lines that
look like errors of their own.

`StartGate` replaces the driver's `sys.stdout` and `sys.stderr` (Ray's printer looks them up at every
line) with streams that hold what is written until rank 0 logs `logs.FIRST_STEP` (the run trained a
step: its task, data, model, snapshot and first loss are good), then write out what they held, in
order, and pass everything through from then on: a training run shows the workers' output as before.
When the run ends before that, `discard()` drops what was held (it stays in Ray's session logs on each
node) for an ending trainapp explains as bad input, and `release()` writes it out for anything else.
The driver's own log lines go to the real stderr throughout (trainapp/observe/logs.py made its handler
before the gate), and a line every `tick_s` says the start is still going on.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, TextIO

from trainapp.observe.logs import FIRST_STEP

log = logging.getLogger("trainapp.ray")

HELD_MAX = 20000
"""Writes held at most; a start that says more than that is shown as it goes (nothing is lost)."""


class _Held:
    """One of the driver's streams while the gate is installed: writes go to the gate; everything else
    (its encoding, fileno, isatty) is the real stream's."""

    def __init__(self, gate: StartGate, real: TextIO) -> None:
        self.gate, self.real = gate, real
        self._line = ""  # what was written since the last newline, to find the marker in whole lines

    def write(self, text: str) -> int:
        self.gate.write(self, text)
        return len(text)

    def flush(self) -> None:
        if self.gate.state != "holding":
            self.real.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class StartGate:
    """Holds Ray's output in the driver until the first step; `install()` to start, then exactly one of
    `release()` or `discard()` once the fit has ended, before Ray shuts down."""

    def __init__(self, tick_s: float = 30.0) -> None:
        self.state = "holding"  # then "open" (passing through) or "closed" (dropping: a failed start)
        self.held: list[tuple[TextIO, str]] = []
        self.dropped = 0
        self.tick_s = tick_s
        self.logs_dir: str | None = None
        """Where the Ray session keeps the lines a failed start drops (the driver sets it once connected)."""
        self._lock = threading.Lock()
        self._streams: tuple[TextIO, TextIO] | None = None
        self._started = time.monotonic()
        self._done = threading.Event()

    def install(self) -> StartGate:
        self._streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Held(self, sys.stdout), _Held(self, sys.stderr)
        if self.tick_s > 0:
            threading.Thread(target=self._tick, name="start-gate", daemon=True).start()
        return self

    def write(self, stream: _Held, text: str) -> None:
        with self._lock:
            if self.state == "open":
                stream.real.write(text)
                return
            if self.state == "closed":
                return
            self.held.append((stream.real, text))
            stream._line += text
            *lines, stream._line = stream._line.split("\n")
            if any(FIRST_STEP in line for line in lines) or len(self.held) > HELD_MAX:
                self._open()

    def _open(self) -> None:
        """Under the lock: write out what was held, in order, and pass through from now on."""
        self.state = "open"
        self._done.set()
        held, self.held = self.held, []
        for real, text in held:
            real.write(text)
        for real in {real for real, _ in held}:
            real.flush()

    def release(self) -> None:
        """The fit ended some other way than bad input: what was held is written out."""
        with self._lock:
            if self.state == "holding":
                self._open()

    def discard(self) -> int:
        """The run failed to start on bad input: what was held is dropped, and so is whatever Ray still
        prints until the driver disconnects; how many lines were dropped (0 once the gate opened)."""
        with self._lock:
            if self.state == "holding":
                self.dropped = sum(text.count("\n") for _, text in self.held)
                self.held = []
                self.state = "closed"
            self._done.set()
            return self.dropped

    def uninstall(self) -> None:
        """After Ray shut down (its printer threads are gone): the real streams back; a Ray logger that
        kept one of the gate's streams passes through it."""
        with self._lock:
            if self.state != "open":
                self.state, self.held = "open", []
            self._done.set()
        if self._streams is not None and isinstance(sys.stdout, _Held) and isinstance(sys.stderr, _Held):
            sys.stdout, sys.stderr = self._streams

    def _tick(self) -> None:
        while not self._done.wait(self.tick_s):
            with self._lock:
                lines = sum(text.count("\n") for _, text in self.held) if self.state == "holding" else None
            if lines is not None:
                log.info("starting for %.0f s: Ray's output (%d lines so far) is shown once the first step "
                         "is trained", time.monotonic() - self._started, lines)
