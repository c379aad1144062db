"""A fork-unsafe library, as CPython 3.11 and older meet one (gh-112275): imported at start-up by every
Python process with this directory on PYTHONPATH (tests/test_loader_start.py), it holds the
interpreter's thread-list lock (HEAD_LOCK, `_PyRuntime.interpreters.mutex`) across the process's
FORK_DEADLOCK_AT-th `os.fork`, as a native thread entering Python would. The child inherits the lock
held and deadlocks in `PyOS_AfterFork_Child` before any of its Python code runs: the real fault, at a
chosen fork instead of 1 in a few hundred. Python 3.11's layout only (the mutex after five ints and an
atomic pointer); elsewhere it does nothing."""

import ctypes
import os
import sys

import _imp

AT = int(os.environ.get("FORK_DEADLOCK_AT", "0"))

if AT and sys.version_info[:2] == (3, 11):
    _api = ctypes.pythonapi
    _api.PyThread_acquire_lock.argtypes = [ctypes.c_void_p, ctypes.c_int]
    _api.PyThread_release_lock.argtypes = [ctypes.c_void_p]
    _RUNTIME = ctypes.addressof(ctypes.c_void_p.in_dll(_api, "_PyRuntime"))
    _MUTEX = ctypes.c_void_p.from_address(_RUNTIME + 32).value
    _forks, _held = [0], [False]

    def _before() -> None:
        _forks[0] += 1
        if _forks[0] == AT:
            # The import lock first: os.fork takes it after these hooks, and waiting for it there lets the
            # other threads run, one of which may need the thread-list lock (a thread ending) and then the
            # GIL back: a deadlock of the parent, which the real fault does not have. Taken here, the fork
            # holds both from now on without letting go of the GIL.
            _imp.acquire_lock()
            _api.PyThread_acquire_lock(_MUTEX, 1)
            _held[0] = True

    def _after_in_parent() -> None:
        if _held[0]:
            _held[0] = False
            _api.PyThread_release_lock(_MUTEX)
            _imp.release_lock()

    os.register_at_fork(before=_before, after_in_parent=_after_in_parent)
