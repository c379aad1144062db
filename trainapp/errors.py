"""How a rank ends, typed, and the one place that turns the ending into the process's exit.

Every ending trainapp explains is a `Failure`: it carries its cause (the `failure` record's, or ''
for an ending that says what happened itself and is no failure), its exit code, and its scope
(`everywhere`: every rank ends the same way at the same step, so no peer needs telling). Exit codes:

- 0: finished;
- 1: a runtime failure, or a rank that ended because a peer failed;
- 2: bad config or bad input (one line naming the key, path or value and what is expected);
- 3: snapshots cannot be written (`snapshot.max_failures` in a row, or the final one);
- 124: the hang watchdog ended a rank that made no progress for `fault.hang_timeout_s`;
- 128 + N: a preemption notice by signal N, handled (143 for SIGTERM: the step reached is snapshotted).

`leave` is the only `os._exit` in trainapp: the watcher threads that must end a process whose main
thread is blocked (a hang, a failed peer, a grace period run out) and a finished training process
all go through it. Standard library only: the config and the command line import this module.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

PEER_EXIT = 1
"""A rank that ends because a peer failed (the peer's own code says why)."""
HUNG_EXIT = 124
"""A rank the hang watchdog ended (as GNU timeout's): not 0, not 2, 3 or 128+N."""


class Failure(Exception):
    """An ending trainapp explains. Subclasses set the class attributes; an instance may override them
    (a failure rebuilt from another process's)."""

    cause = "exception"
    """The `failure` record's cause; '' for an ending that is no failure (bad input, a handled notice)."""
    exit_code = 1
    everywhere = False
    """Every rank raises it at the same step (a verdict they all received): no peer to tell."""


class ConfigError(Failure, ValueError):
    """Bad configuration or bad input: the CLI prints the message as one line and exits 2."""

    cause = ""
    exit_code = 2

    def __init__(self, *args: object) -> None:
        # Raised in a DataLoader worker (a task's collate or dataset), it is re-raised in the training
        # process as this class made from torch's message, which wraps the worker's traceback: the one
        # line is that traceback's last, the message it was raised with.
        if len(args) == 1 and isinstance(args[0], str) and "\nOriginal Traceback" in args[0]:
            last = args[0].strip().splitlines()[-1]
            args = (last.split(": ", 1)[1] if ": " in last else last,)
        super().__init__(*args)


def first_line(e: BaseException) -> str:
    """`Type: the first line of its message`, for a one-line error that names what went wrong."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def exit_code(e: BaseException | None) -> int:
    """The process's exit code for how its work ended: `e` None when it finished."""
    if e is None:
        return 0
    if isinstance(e, Failure):
        return e.exit_code
    if isinstance(e, KeyboardInterrupt):
        return 130
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else 1
    return 1


def leave(code: int) -> NoReturn:
    """End this process now with `code`, from any thread, after flushing what it printed and logged.

    A finished training process leaves this way too: its snapshots are on disk, its metrics closed and
    its process group destroyed, and the interpreter's own teardown then has nothing left to do but
    run torch's C++ destructors, one of which sometimes aborts a finished rank ("terminate called
    without an active exception", about 1 run in 10 with snapshot.async=true under torchrun)."""
    import multiprocessing

    # A child whose own code cannot run (a DataLoader worker deadlocked in its fork, trainapp/core/
    # loader_start.py) would outlive the process and hold its pipes: end every child it started.
    for child in multiprocessing.active_children():
        try:
            child.kill()
        except OSError:  # ended meanwhile
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    logging.shutdown()
    os._exit(code)
