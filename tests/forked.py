"""`python -m trainapp ARGS` and `torchrun ARGS` as a child forked from the test's own process, which has
torch imported already: a fresh interpreter spends 2 to 3 s of CPU importing torch on these machines,
most of a bad-input check or a short single-process run, and of torchrun's agent (issue 71). The ranks
torchrun starts are fresh interpreters, as ever.

The child is a real process (its own PID, session, exit code, stdout and stderr; `drill.*` kills it as any
rank), started from a copy of this one instead of from `exec`. What a fresh interpreter would have and the
test's process does not is put back before the module's `__main__` runs: the environment, the working
directory, `tempfile`'s directory (from the child's `TMPDIR`), `sys.path` (the interpreter's own, then
`PYTHONPATH`) and only the modules it reaches, one intra-op thread (`OMP_NUM_THREADS`, as `run_cmd` gives
a process), Python's default warning filters and warning output, no logging handler on the root logger,
the default signal dispositions and hooks, no multiprocessing children, `atexit` functions of its own
only, and nothing of the test's process collected (so none of its objects is finalized here).

What it cannot put back: modules the test's process imported that the child's path also reaches stay
imported (settings read from the environment at import time keep the test's values), and the child
holds copies of the test process's open files (closing them would let the child reuse their numbers
under objects that still write to them). A test of start-up itself (a `sitecustomize`, import-time
settings, interpreter flags) runs a fresh process: `fresh=True` to `helpers.run_cmd` or `trainapp`."""

from __future__ import annotations

import atexit
import faulthandler
import functools
import gc
import importlib.machinery
import io
import json
import locale
import logging
import multiprocessing.process
import os
import runpy
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def _interpreter_path() -> tuple[str, ...]:
    """`sys.path` of a fresh `python -m` in REPO without `PYTHONPATH`, less its first entry (the
    working directory): the standard library, site-packages and the editable install's entries."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                         cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    return tuple(json.loads(out))


@functools.cache
def _fresh_warnings() -> object:
    """A copy of the `warnings` module as a fresh interpreter has it (pytest records warnings instead
    of printing them while a test runs): its `_showwarnmsg_impl` prints to stderr."""
    import importlib.util

    spec = importlib.util.find_spec("warnings")
    assert spec is not None and spec.loader is not None
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    return fresh


_KEPT: list[object] = []
"""The modules the child dropped from `sys.modules`, still referenced: nothing of the test's process is
finalized in the child (a copied DataLoader iterator's finalizer would stop the test process's workers)."""


def _forget_unreachable() -> None:
    """Drop the modules (and their submodules) that this `sys.path` would not import from the same file:
    the test's own (helpers, the user tasks on tests/usertasks) stay out of reach, as in a fresh
    interpreter without them on its path."""
    gone = []
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if "." in name or name.startswith("__") or not origin:
            continue
        spec = importlib.machinery.PathFinder.find_spec(name, sys.path)
        if spec is None or spec.origin != origin:
            gone.append(name)
    for name in list(sys.modules):
        if name.split(".", 1)[0] in gone:
            _KEPT.append(sys.modules.pop(name))


def _as_fresh(env: dict[str, str]) -> None:
    """In the child: what a fresh interpreter started with `env` in REPO would have (module docstring)."""
    os.chdir(REPO)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # the test process's cached choice: the child's TMPDIR decides, as at a start
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [str(REPO), *extra, *_interpreter_path()]
    _forget_unreachable()
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    # New stream objects: another thread of the test's process may have held the old ones' locks.
    for fd, mode in ((0, "r"), (1, "w"), (2, "w")):
        stream = io.TextIOWrapper(io.FileIO(fd, mode, closefd=False), line_buffering=True,
                                  write_through=mode == "w")
        setattr(sys, ("stdin", "stdout", "stderr")[fd], stream)
    faulthandler.disable()
    fresh = _fresh_warnings()
    warnings._showwarnmsg_impl = fresh._showwarnmsg_impl  # type: ignore[attr-defined]
    warnings.showwarning = warnings._showwarning_orig  # type: ignore[attr-defined]
    warnings.resetwarnings()  # then the interpreter's defaults, then PYTHONWARNINGS before them
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__", append=True)
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category, append=True)
    warnings._processoptions([o for o in env.get("PYTHONWARNINGS", "").split(",") if o])  # type: ignore
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            ignored = signum in (signal.SIGPIPE, signal.SIGXFSZ)  # as the interpreter sets them at start
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT
                          else signal.SIG_IGN if ignored else signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    sys.excepthook, sys.unraisablehook = sys.__excepthook__, sys.__unraisablehook__
    threading.excepthook = threading.__excepthook__
    multiprocessing.process._children.clear()  # type: ignore[attr-defined]  # the test process's, not ours
    atexit._clear()  # the test process's exit functions (its temporary directories) are not the child's
    gc.freeze()  # and no object copied from it is collected (and finalized) here


def _child(module: str, args: list[str], env: dict[str, str], out_w: int, err_w: int) -> None:
    """Runs in the forked child and never returns."""
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, to in ((0, null), (1, out_w), (2, err_w)):
            os.dup2(to, fd)
        for fd in (null, out_w, err_w):
            os.close(fd)
        try:
            _as_fresh(env)
            sys.argv = [module, *args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:  # what the interpreter prints for an uncaught exception
            traceback.print_exc()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)


def _decoded(raw: bytes) -> str:
    """As `subprocess` with `text=True` decodes a child's output (universal newlines)."""
    return io.TextIOWrapper(io.BytesIO(raw), encoding=locale.getpreferredencoding(False)).read()


_AUTOGRAD_FORKED_BAD = False
"""Whether this process has been found unable to fork a child that runs autograd (`usable`)."""


def usable() -> bool:
    """Whether a child forked from this process now can train. Not once this process has started
    autograd's device threads (an in-process `torch.compile` whose model ran backward does, whatever
    its backend): from then on every forked child's backward fails ("Unable to handle autograd's
    threading in combination with fork-based multiprocessing"), and the test's command must start a
    fresh interpreter instead. A forked probe that runs one backward tells; about 25 ms, and once it
    fails this process is never asked again."""
    global _AUTOGRAD_FORKED_BAD
    if not _AUTOGRAD_FORKED_BAD:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                torch.ones(1, requires_grad=True).sum().backward()
                code = 0
            finally:
                os._exit(code)
        _AUTOGRAD_FORKED_BAD = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0
    return not _AUTOGRAD_FORKED_BAD


def run(module: str, args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """`python -m MODULE ARGS` with `env` as its whole environment, forked from this process: its
    exit code (minus the signal that ended it, as `subprocess` gives it), stdout and stderr. On timeout
    its whole session is SIGKILLed and AssertionError says so with the output so far."""
    _interpreter_path(), _fresh_warnings()  # here, once: the child starts nothing of its own for them
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(out_r)
        os.close(err_r)
        _child(module, args, env, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
        timed_out = bool(sel.get_map())
    for fd in chunks:
        os.close(fd)
    if timed_out:
        os.killpg(pid, signal.SIGKILL)
    status = os.waitpid(pid, 0)[1]
    try:
        os.killpg(pid, signal.SIGKILL)  # stragglers of its own session only
    except ProcessLookupError:
        pass
    out, err = (_decoded(b"".join(chunks[fd])) for fd in (out_r, err_r))
    if timed_out:
        raise AssertionError(f"timed out after {timeout}s: python -m {module} {' '.join(args)}\n"
                             f"{out[-4000:]}\n{err[-3000:]}")
    return os.waitstatus_to_exitcode(status), out, err
