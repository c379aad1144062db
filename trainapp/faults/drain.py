"""The node side of a preemption notice: the worker registry, `trainapp drain` and `trainapp node`.

Every training process writes its PID under `TRAINAPP_RUNTIME_DIR` (`register`, by its launcher), so
`trainapp drain` (a pod's preStop, a container's stop trap) can send exactly those processes the
notice and wait for their snapshot, and `trainapp node` runs a node's command as a container's main
process and drains the node before stopping it. No torch here: these commands run beside training,
in a container's last seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainapp.errors import ConfigError

log = logging.getLogger(__name__)

RUNTIME_ENV = "TRAINAPP_RUNTIME_DIR"
"""Node-local directory of the worker registry (default /tmp/trainapp-runtime)."""


def runtime_dir(root: str | Path | None = None) -> Path:
    return Path(root or os.environ.get(RUNTIME_ENV) or "/tmp/trainapp-runtime") / "workers"


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (state first), None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat): a PID with another start
    time is a reused PID, not our worker."""
    stat = _stat(pid)
    return stat[19] if stat else None


def _running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie has exited; only its parent has not reaped it


def register() -> Path | None:
    """Write this process's entry in the registry; removed by `unregister` (or found stale later)."""
    d = runtime_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        entry = d / str(os.getpid())
        entry.write_text(f"{_start_time(os.getpid())}\n")
        return entry
    except OSError as e:
        log.warning("preemption: cannot register this worker under %s (%s); `trainapp drain` will not see it",
                    d, e)
        return None


def unregister(entry: Path | None) -> None:
    if entry is not None:
        with contextlib.suppress(OSError):
            entry.unlink()


def registered(root: str | Path | None = None) -> list[int]:
    """PIDs of live registered workers on this node (stale entries are removed); `root`: another
    registry than TRAINAPP_RUNTIME_DIR's."""
    live = []
    d = runtime_dir(root)
    for entry in sorted(d.glob("[0-9]*")) if d.is_dir() else []:
        pid = int(entry.name)
        try:
            ok = _start_time(pid) == entry.read_text().strip()
        except OSError:
            ok = False
        if ok:
            live.append(pid)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
    return live


def _ray_drain(deadline_s: int) -> str:
    """Tell Ray this node is being preempted, so Ray Train snapshots in time and restarts elsewhere."""
    ray = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    cmd = [ray, "drain-node", "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
           "trainapp drain (pod deleted or container stopped)",
           "--deadline-remaining-seconds", str(deadline_s)]
    try:
        # Bounded: the drain wait that follows must still fit the platform's grace period.
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"ray drain-node failed ({e.__class__.__name__}: {e})"
    if r.returncode != 0:
        last = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["no output"]
        return f"ray drain-node failed (exit {r.returncode}: {last[0]})"
    return f"Ray node drained for preemption, deadline {deadline_s} s"


def drain(wait_s: float, ray_deadline_s: int | None = None,
          poll_s: float = 0.1) -> tuple[list[int], list[int], str]:
    """This node is going away: drain its Ray node (when asked), send every registered training process
    on it SIGTERM, and wait up to `wait_s` for them to exit. (stopped PIDs, still running PIDs, what the
    Ray drain said)."""
    said = _ray_drain(ray_deadline_s) if ray_deadline_s is not None else ""
    pids = registered()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + wait_s
    left = list(pids)
    while left and time.monotonic() < end:
        time.sleep(poll_s)
        left = [p for p in left if _running(p)]
    return [p for p in pids if p not in left], left, said


def drain_line(stopped: list[int], left: list[int], wait_s: float) -> str:
    """What a drain did, in one line (`trainapp drain` and `trainapp node` print it)."""
    return (f"{len(stopped)} training process(es) stopped with their snapshot"
            + (f" (pids {' '.join(map(str, stopped))})" if stopped else "")
            + (f"; still running after {wait_s:g} s: pids {' '.join(map(str, left))}" if left else ""))


def supervise(cmd: list[str], wait_s: float, ray_deadline_s: int | None) -> int:
    """Run `cmd` (e.g. `ray start --block`) as a container's main process; on SIGTERM or SIGINT (`docker
    stop`, a pod deleted) first `drain` this node, then pass the signal on and return 128 + it."""
    got: list[int] = []
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        child = subprocess.Popen(cmd)
    except OSError as e:
        raise ConfigError(f"trainapp node: cannot run {cmd[0]!r} ({e.strerror}); "
                          "give the node's command after --")
    while child.poll() is None and not got:
        time.sleep(0.2)
    if not got:
        return child.returncode
    name = signal.Signals(got[0]).name
    print(f"trainapp node: {name}: draining this node before stopping {cmd[0]}", flush=True)
    stopped, left, said = drain(wait_s, ray_deadline_s)
    if said:
        print(f"trainapp node: {said}", flush=True)
    print(f"trainapp node: {drain_line(stopped, left, wait_s)}", flush=True)
    child.send_signal(got[0])
    try:
        child.wait(timeout=15)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    return 128 + got[0]
