"""Every failure explained: whatever ends a rank leaves one line and a `failure` record, and its
peers follow it out within seconds.

The record goes to `run.dir/metrics.jsonl` from the failing rank itself (one append of one line:
rank 1's failure is on record, not only rank 0's). Its fields: rank, host, step and phase (from the
heartbeat), cause, error, exit_code, attempt; for an out-of-memory error also the device's memory
(the allocator's peak and a short summary on a GPU, the peak RSS on CPU). Causes:

- `exception`: the loop raised (a bug, a data error);
- `oom`: `torch.OutOfMemoryError`;
- `storage`: snapshots cannot be written (every rank stops together, see trainapp/snapshots/manager.py);
- `hang`: the watchdog found no progress (trainapp/faults/heartbeat.py);
- `signal`: a preemption notice whose grace period ran out before the agreed stop;
- `peer`: another rank failed first, or the group's store stopped answering.

A SIGKILL (the kernel's OOM killer, a lost node) leaves no record: `trainapp report` names such an
attempt by the restart that followed it.

Peers: a failing rank posts its line in the group's store (a client of its own, not the process
group: a collective is what hangs). Every rank polls that key once a second from a thread and, once
a peer posted, records `peer` and exits at once, also while its training thread is blocked in a
collective with the failed rank, which NCCL would hold for its whole timeout (10 minutes by default).
The launcher then restarts the group as it would for the failed rank alone.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from trainapp.errors import PEER_EXIT, Failure, first_line
from trainapp.faults.heartbeat import Heartbeat
from trainapp.observe import metrics
from trainapp.snapshots.lease import Fence

if TYPE_CHECKING:  # torch is not imported with this module (see `explain`)
    import torch
    from torch.distributed import Store

    from trainapp.group import DistContext

POLL_S = 1.0
"""How often each rank asks the store whether a peer failed."""
STORE_MISSES = 3
"""Polls in a row the store may fail to answer before its host counts as gone."""
KEY = "failed"
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What Gloo's errors say when the process at the other end of a collective is gone."""


def host() -> str:
    return os.uname().nodename


class FailureLog:
    """This rank's failure record and its word to the peers. `heartbeat` says where the rank was;
    `begin` says where the record goes and which store the peers read; `leave(code)` ends the process
    (trainapp.errors.leave, or a test's stand-in)."""

    def __init__(self, heartbeat: Heartbeat, leave: Callable[[int], None]) -> None:
        self.heartbeat, self.leave = heartbeat, leave
        self.run_dir: Path | None = None
        self.device: torch.device | None
        self.store: Store | None
        self.rank, self.device, self.store, self.attempt = 0, None, None, 0
        self.done = False  # this process's failure is recorded: nothing more to say
        self.lock = threading.Lock()
        self.fence: Fence = Fence.none()
        """The run's lease: a rank of a run whose lease was taken over records nothing in the directory
        that is no longer its run's (it still prints its line)."""

    def what(self, cause: str, error: str) -> str:
        """'rank R on HOST failed after step S in phase P: CAUSE: ERROR' (what peers are told)."""
        hb = self.heartbeat
        return (f"rank {self.rank} on {host()} failed after step {hb.step} in phase {hb.phase}: "
                f"{cause}: {error}")

    def line_for(self, cause: str, error: str, code: int) -> str:
        return f"trainapp: {self.what(cause, error)}; exiting with {code}"

    def record(self, cause: str, error: str, exit_code: int, post: bool = True, **extra: Any) -> str:
        """Write this rank's `failure` record and print its line (once per process); post it to the peers
        unless every rank fails the same way at once. Returns the line ('' when one was recorded before).
        Safe from any thread."""
        with self.lock:
            if self.done:
                return ""
            self.done = True
        line = self.line_for(cause, error, exit_code)
        fields = {"rank": self.rank, "host": host(), "step": self.heartbeat.step,
                  "phase": self.heartbeat.phase, "cause": cause, "error": error, "exit_code": exit_code,
                  "attempt": self.attempt, **extra}
        if self.run_dir is not None and not self._fenced():
            try:
                metrics.append(self.run_dir, "failure", **fields)
            except OSError as e:  # the storage may be what failed: the line still says it
                line += f" (no failure record: {e})"
        print(line, file=sys.stderr, flush=True)
        if post and self.store is not None:
            with contextlib.suppress(Exception):  # a store that is gone has no one left to tell
                self.store.set(KEY, self.what(cause, error))
        return line

    def _fenced(self) -> bool:
        try:
            return self.fence.lost()
        except OSError:  # storage that cannot answer: the record's own write says how it fares
            return False

    def end(self, cause: str, error: str, exit_code: int, **extra: Any) -> None:
        """Record a failure found outside the training thread (a hang, a grace period run out) and end the
        process, whatever it was doing: its main thread may be blocked for good."""
        self.record(cause, error, exit_code, **extra)
        self.leave(exit_code)

    def explain(self, e: BaseException) -> tuple[str, str, dict[str, Any]] | None:
        """(cause, error, extra fields) of an exception that ends this rank; None for an ending that is
        not a failure (a handled preemption, bad input: each says so itself)."""
        cause = e.cause if isinstance(e, Failure) else "exception"
        if not cause or isinstance(e, (KeyboardInterrupt, SystemExit)):
            return None
        error, extra = first_line(e), {}
        if type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
            cause, extra["memory"] = "oom", memory(self.device)
            mem = extra["memory"]
            peak = mem.get("peak_allocated_mb", mem.get("peak_rss_mb"))
            error += f" (peak {peak} MB on {mem['device']})" if peak is not None else ""
        if cause == "exception":
            # A collective that broke because a peer went away: the peer's failure is the cause.
            peer = self._peer_line()
            if peer:
                return "peer", f"{peer} (here: {error})", {"peer": peer}
            if any(s in str(e) for s in PEER_GONE):
                return "peer", f"a peer's connection closed: it died without a word (SIGKILL, the OOM " \
                               f"killer, a lost node) ({error})", {"peer": "unknown"}
        return cause, error, extra

    def _peer_line(self) -> str:
        with contextlib.suppress(Exception):
            return posted(self.store) if self.store is not None else ""
        return ""

    @contextlib.contextmanager
    def watching(self, run_dir: str | Path, ctx: DistContext, store: Callable[[], Any],
                 attempt: int = 0) -> Iterator[None]:
        """The run of this rank: exceptions out of the block are recorded (and re-raised), and peers'
        failures are watched for through the store `store()` returns (the group's, None alone). Leave the
        block before the process group goes away: rank 0 may host the store."""
        self.run_dir, self.rank, self.device, self.attempt = Path(run_dir), ctx.rank, ctx.device, attempt
        watch = None
        try:
            self.store = store()
            watch = PeerWatch(self) if self.store is not None else None
            yield
        except BaseException as e:
            explained = self.explain(e)
            if explained is not None:
                cause, error, extra = explained
                everywhere = isinstance(e, Failure) and e.everywhere
                self.record(cause, error, e.exit_code if isinstance(e, Failure) else 1, post=not everywhere,
                            **extra)
            raise
        finally:
            if watch is not None:
                watch.stop.set()


def posted(store: Store) -> str:
    """A peer's failure line from the store, '' while there is none; raises when the store is gone."""
    return store.get(KEY).decode(errors="replace") if store.check([KEY]) else ""


class PeerWatch:
    """Polls the store for a peer's failure once a second, from a thread, and ends this rank once one is
    posted or the store stops answering."""

    def __init__(self, log: FailureLog) -> None:
        assert log.store is not None  # a rank alone has no peers to watch
        self.log, self.store = log, log.store
        self.stop = threading.Event()
        threading.Thread(target=self._run, name="peer-watch", daemon=True).start()

    def _run(self) -> None:
        misses = 0
        while not self.stop.wait(POLL_S):
            try:
                peer = posted(self.store)
                misses = 0
            except Exception as e:
                misses += 1
                if misses >= STORE_MISSES and not self.stop.is_set():
                    self._leave(f"the group's store stopped answering ({first_line(e)}): its host, rank 0 or "
                                "the launcher, is gone")
                continue
            if peer and not self.stop.is_set():
                self._leave(peer)

    def _leave(self, why: str) -> None:
        # Only a rank that has not failed itself: one whose own ending is under way keeps its own code.
        if self.log.record("peer", why, PEER_EXIT, post=False, peer=why):
            self.log.leave(PEER_EXIT)


def memory(device: torch.device | None) -> dict[str, Any]:
    """The device's memory at an out-of-memory error. Every call is guarded: after a CUDA OOM the
    allocator answers, but a broken context must not turn the explanation into a second error."""
    mb = 2 ** 20
    out: dict[str, Any] = {"device": str(device)}
    if device is not None and device.type == "cuda":
        import torch

        idx = device.index if device.index is not None else 0
        for key, fn in (("peak_allocated_mb", torch.cuda.max_memory_allocated),
                        ("allocated_mb", torch.cuda.memory_allocated),
                        ("reserved_mb", torch.cuda.memory_reserved)):
            with contextlib.suppress(Exception):
                out[key] = round(fn(idx) / mb, 1)
        with contextlib.suppress(Exception):
            free, total = torch.cuda.mem_get_info(idx)
            out["free_mb"], out["total_mb"] = round(free / mb, 1), round(total / mb, 1)
        with contextlib.suppress(Exception):
            out["summary"] = summary_rows(torch.cuda.memory_summary(idx, abbreviated=True))
    else:
        # Linux reports ru_maxrss in KiB.
        out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


SUMMARY_ROWS = ("Metric", "Allocated memory", "Active memory", "Requested memory", "GPU reserved memory",
                "Non-releasable memory", "Allocations", "Oversize allocations")


def summary_rows(table: str) -> list[str]:
    """The rows of `torch.cuda.memory_summary(abbreviated=True)` worth a record ('Allocated memory |
    cur | peak | allocs | frees' and the like), whitespace collapsed."""
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and (cells[0] in SUMMARY_ROWS or cells[0].startswith("CUDA OOMs")):
            rows.append(" | ".join(" ".join(c.split()) for c in cells))
    return rows
