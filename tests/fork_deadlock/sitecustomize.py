"""A fork-unsafe library, as CPython 3.11 and older meet one (gh-112275): imported at start-up by every
Python process with this directory on PYTHONPATH (tests/test_loader_start.py), it holds the
interpreter's thread-list lock (HEAD_LOCK, `_PyRuntime.interpreters.mutex`) across the process's
FORK_DEADLOCK_AT-th `os.fork`, as a native thread entering Python would. The child inherits the lock
held and deadlocks in `PyOS_AfterFork_Child` before any of its Python code runs: the real fault, at a
chosen fork instead of 1 in a few hundred. Python 3.11's layout only (the mutex after five ints and an
atomic pointer); elsewhere it does nothing.

The lock is taken and given back by C callables only (ctypes functions bound with `functools.partial`),
never by Python code. Python code holding it could let the GIL go at its next instruction, and a thread
that then ends (it holds the GIL and waits for the thread-list lock) would deadlock the parent, which the
real fault never does: seen under load with a Python hook."""

import ctypes
import functools
import os
import sys

import _imp

AT = int(os.environ.get("FORK_DEADLOCK_AT", "0"))

if AT and sys.version_info[:2] == (3, 11):
    _api = ctypes.pythonapi
    _api.PyThread_allocate_lock.restype = ctypes.c_void_p
    _api.PyThread_acquire_lock.argtypes = [ctypes.c_void_p, ctypes.c_int]
    _api.PyThread_release_lock.argtypes = [ctypes.c_void_p]
    _RUNTIME = ctypes.addressof(ctypes.c_void_p.in_dll(_api, "_PyRuntime"))
    _HEAD_LOCK = ctypes.c_void_p.from_address(_RUNTIME + 32).value
    _SPARE = _api.PyThread_allocate_lock()  # what the other forks take and give back: nobody else's
    _target = ctypes.c_void_p(_SPARE)  # read by the C callables when they run
    _forks = [0]

    def _choose() -> None:
        _forks[0] += 1
        _target.value = _HEAD_LOCK if _forks[0] == AT else _SPARE

    # Before-fork hooks run in the reverse order of registration, the others in that order: the import
    # lock first (os.fork takes it after the hooks, and waiting for it there would let other threads
    # run), then the choice (made anew at every fork), then the lock; after the fork the lock goes first.
    _take = functools.partial(_api.PyThread_acquire_lock, _target, 1)
    _give = functools.partial(_api.PyThread_release_lock, _target)
    os.register_at_fork(before=_take, after_in_parent=_give, after_in_child=_give)
    os.register_at_fork(before=_choose)
    os.register_at_fork(before=_imp.acquire_lock, after_in_parent=_imp.release_lock,
                        after_in_child=_imp.release_lock)
