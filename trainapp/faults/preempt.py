"""Preemption notices: a signal, or a Ray node drain, becomes a snapshot of the step reached.

Three pieces, each with one job:

- `install` (once per process, main thread): handlers for SIGTERM, SIGINT and `preempt.signals`.
  The handler only records the signal. A watcher thread wakes on the same signal through
  `signal.set_wakeup_fd`, so it sees the signal even while the main thread sits in a blocked
  collective, logs it, and arms the `preempt.grace_s` deadline: if the process has not exited by
  then, it exits anyway with 128 + the signal. The newest valid snapshot is what it was (writes are
  atomic), and a peer that is gone or hung cannot hold the process past the platform's grace period.
- `StopVote` (per run, every rank): about twice a second (at most once a step) the ranks agree
  whether any of them got a signal, so all stop after the same step, and whether it is time to ask
  Ray Train about drained nodes (a barrier every rank must enter at the same step). A vote is an
  asynchronous all-reduce started at one step boundary and read at the next, so the loop never waits
  on it.
- The worker registry: every training process writes its PID under `TRAINAPP_RUNTIME_DIR`, so
  `trainapp drain` (a pod's preStop, a container's stop trap) can send exactly those processes the
  notice and wait for their snapshot.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from trainapp.faults import failure, heartbeat

log = logging.getLogger(__name__)

ALWAYS = ("SIGTERM", "SIGINT")
RUNTIME_ENV = "TRAINAPP_RUNTIME_DIR"
"""Node-local directory of the worker registry (default /tmp/trainapp-runtime)."""


class Preempted(Exception):
    """Raised out of `Trainer.train()` on every rank once the stop step's snapshot is written."""

    failure_cause = ""  # a handled notice, on record as `preempted`, not a failure

    def __init__(self, signum: int, step: int, seconds: float, snapshot: str | None, rank: int = 0):
        self.signum, self.step, self.seconds, self.snapshot, self.rank = signum, step, seconds, snapshot, rank
        super().__init__(self.line())

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self) -> str:
        return (f"trainapp: preempted ({signal.Signals(self.signum).name}) at step {self.step} after "
                f"{self.seconds:.1f} s; snapshot {self.snapshot}; rerun the same command to resume")


class _Notice:
    """The process-wide state of a notice: the first signal, when it came, the deadline armed on it."""

    def __init__(self) -> None:
        self.signum = 0
        self.at = 0.0  # time.monotonic() of the first signal
        self.grace_s = 25.0
        self.signals: set[int] = set()
        self.watching = False
        self.armed = False
        self.lock = threading.Lock()
        self.snapshots = "the run's snapshots directory"
        self.phase_at_signal = ""  # trainapp.faults.heartbeat's phase when the first signal came
        self.done = False  # this process's training is over (a Ray worker lives on): signals are not notices


_notice = _Notice()


def received() -> int:
    """The signal number of the first notice this process got, 0 if none."""
    return _notice.signum


def seconds_since() -> float:
    return time.monotonic() - _notice.at if _notice.signum else 0.0


def phase_at_signal() -> str:
    return _notice.phase_at_signal


def training_over() -> None:
    """Training in this process is over (finished, failed or stopped): from now on a signal is not a
    notice, it ends the process as it would without trainapp (Ray stops a finished worker group with
    SIGTERM: no "stopping after the next step" then)."""
    _notice.done = True


def describe_snapshots(where: str) -> None:
    """What the deadline's message names as the snapshots left intact."""
    _notice.snapshots = where


def _record(signum: int) -> None:
    if not _notice.signum:
        _notice.at, _notice.phase_at_signal = time.monotonic(), heartbeat.state.phase
        _notice.signum = signum


def _handler(signum, frame) -> None:
    # Runs in the main thread between bytecodes: record only; logging here could deadlock on a lock
    # the interrupted code holds. The watcher thread arms the deadline (here only without one).
    if _notice.done:  # no training left to save: the signal does what it would without us
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _record(signum)
    if not _notice.watching:
        _arm(signum)


def _arm(signum: int) -> None:
    """First notice: log it and start the deadline; later ones: say they change nothing."""
    if _notice.done:
        return
    with _notice.lock:
        first = not _notice.armed
        _notice.armed = True
        _record(signum)  # the watcher may see a signal before the blocked main thread runs the handler
    name = signal.Signals(signum).name
    if first and heartbeat.state.phase == "start":  # no step trained yet in this process: nothing to save
        failure.record("signal", f"{name} before training started; nothing to save", 128 + signum)
        os._exit(128 + signum)
    if not first:
        log.warning("preemption: %s again; already stopping (the snapshot is on its way; exit at the latest %.0f s "
                    "after the first notice)", name, _notice.grace_s)
        return
    log.warning("preemption: %s received; stopping after the next step with a snapshot (preempt.grace_s=%g)",
                name, _notice.grace_s)
    remaining = max(0.0, _notice.grace_s - seconds_since())
    timer = threading.Timer(remaining, _expire)
    timer.daemon = True
    timer.start()


def _expire() -> None:
    code = 128 + _notice.signum
    failure.record("signal", f"{signal.Signals(_notice.signum).name}: preempt.grace_s={_notice.grace_s:g} ran out "
                   f"before the stop was agreed and its snapshot written (a peer gone or hung?); the newest valid "
                   f"snapshot in {_notice.snapshots} is unchanged", code)
    os._exit(code)


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum in _notice.signals:
                _arm(signum)


def install(names: list[str], grace_s: float) -> bool:
    """Handle SIGTERM, SIGINT and `names` as preemption notices in this process. Call from the main
    thread (Python delivers signals there); False, with a warning, where that is impossible."""
    _notice.grace_s = grace_s
    nums = {signal.Signals[n] for n in (*ALWAYS, *names)}
    if threading.current_thread() is not threading.main_thread():
        log.warning("preemption: signal handlers can only be installed from the main thread; %s will end this "
                    "process without a snapshot", ", ".join(sorted(n.name for n in nums)))
        return False
    for s in nums:
        signal.signal(s, _handler)
    _notice.signals = {int(s) for s in nums}
    if not _notice.watching:
        r, w = os.pipe()
        os.set_blocking(w, False)
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if old != -1:  # someone else's wakeup fd (an asyncio loop in this thread): leave it theirs
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
        else:
            threading.Thread(target=_watch, args=(r,), name="preempt-watch", daemon=True).start()
            _notice.watching = True
    return True


class StopVote:
    """Agrees across ranks on the step to stop at: call `stop(step)` at every step boundary on every rank.

    A vote is an asynchronous all-reduce (MAX) of [this rank's signal number, the step this rank
    proposes for the next vote], started at one boundary and read at the next: it overlaps a step,
    and every rank reads the same answer at the same boundary. Votes come about every `INTERVAL_S`
    (each rank proposes from its own step time; the MAX is what all adopt), every step once steps take
    that long. A vote costs a fraction of a millisecond of CPU (the wake-up of Gloo's thread and a
    round trip; bench/preempt.py measures it): nothing against a 100 ms step, percents against a 5 ms
    one, so the loop votes by time, not by step. Under NCCL the vote runs on a Gloo group of its own, so it is a CPU tensor and never
    synchronises the device.

    With `poll_s` > 0 the vote also carries whether `poll_s` has passed on any rank since the ranks
    last polled: `take_poll()` is then true at the same boundary on every rank (the boundary where
    that vote is read), so a barrier such as `ray.train.get_preemption_info()` goes by time too, without
    a collective of its own. With `pending` (a cheap local check: has this rank been told of a
    notice?) a rank proposes a poll only while `pending()` is true, so the barrier is not paid at all
    until some rank has a notice, and then at the next vote.
    """

    INTERVAL_S = 0.5
    """The stop comes at most this long (plus one step) after a rank saw the signal: well inside any
    platform's grace period."""
    MAX_EVERY = 50

    def __init__(self, ctx, poll_s: float = 0.0, pending: Callable[[], bool] | None = None) -> None:
        import torch
        import torch.distributed as tdist  # here: `trainapp drain`/`node` import this module without torch

        self.ctx, self.dist = ctx, tdist
        self.group = None
        if ctx.distributed and tdist.get_backend() != "gloo":
            self.group = tdist.new_group(backend="gloo")  # collective: every rank builds the vote together
        self.flag = torch.zeros(3, dtype=torch.int64)
        self.work = None
        self.next_vote = 0  # agreed: the boundary of the next vote
        self.last_t, self.step_s = None, None
        self.poll_s, self.pending = poll_s, pending
        self.polled_t = time.perf_counter()  # the start counts as a poll: a drain seen at once needs none
        self._poll = False  # the ranks agreed to poll at this boundary; cleared by take_poll

    def _poll_due(self, now: float) -> bool:
        return self.poll_s > 0 and now - self.polled_t >= self.poll_s and (self.pending is None or self.pending())

    def _polls(self, agreed: bool, now: float) -> None:
        if agreed:
            self._poll, self.polled_t = True, now

    def take_poll(self) -> bool:
        """True, once, at a boundary where the ranks agreed to poll (`poll_s`): the same on every rank."""
        poll, self._poll = self._poll, False
        return poll

    def stop(self, step: int) -> int:
        """The agreed signal number at this boundary, 0 to go on (and `take_poll` answers for it)."""
        now = time.perf_counter()
        if not self.ctx.distributed:
            self._polls(self._poll_due(now), now)
            return received()
        if self.last_t is not None:
            dt = now - self.last_t
            self.step_s = dt if self.step_s is None else 0.8 * self.step_s + 0.2 * dt
        self.last_t = now
        if self.work is not None:  # started at the previous boundary
            self.work.wait()
            self.work = None
            agreed, self.next_vote, poll = (int(v) for v in self.flag.tolist())
            if agreed:
                return agreed
            self._polls(bool(poll), now)
        if step >= self.next_vote:
            every = 1 if not self.step_s else min(self.MAX_EVERY, max(1, int(self.INTERVAL_S / self.step_s)))
            self.flag[0], self.flag[1], self.flag[2] = received(), step + every, self._poll_due(now)
            self.work = self.dist.all_reduce(self.flag, op=self.dist.ReduceOp.MAX, group=self.group, async_op=True)
        return 0

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the vote in flight (the last boundary's), before the process group goes away; bounded,
        for the case of an error that a peer did not share."""
        if self.work is not None:
            import datetime

            with contextlib.suppress(Exception):
                self.work.wait(datetime.timedelta(seconds=timeout_s))
            self.work = None


# ----------------------------------------------------------------------------------------------
# The worker registry and `trainapp drain`


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
        log.warning("preemption: cannot register this worker under %s (%s); `trainapp drain` will not see it", d, e)
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
    import shutil
    import subprocess

    ray = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    cmd = [ray, "drain-node", "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
           "trainapp drain (pod deleted or container stopped)", "--deadline-remaining-seconds", str(deadline_s)]
    try:
        # Bounded: the drain wait that follows must still fit the platform's grace period.
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"ray drain-node failed ({e.__class__.__name__}: {e})"
    if r.returncode != 0:
        last = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["no output"]
        return f"ray drain-node failed (exit {r.returncode}: {last[0]})"
    return f"Ray node drained for preemption, deadline {deadline_s} s"


def drain(wait_s: float, ray_deadline_s: int | None = None, poll_s: float = 0.1) -> tuple[list[int], list[int], str]:
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
    import subprocess

    got: list[int] = []
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        child = subprocess.Popen(cmd)
    except OSError as e:
        from trainapp.config import ConfigError

        raise ConfigError(f"trainapp node: cannot run {cmd[0]!r} ({e.strerror}); give the node's command after --")
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
