"""One run per run directory: the lease a run holds on its directory from start to end, and the fence
that stops a writer whose lease was taken over (docs/run-directory.md).

The lease is the folder `lease/` of the run directory (`run.dir`, or `ray.storage_path/ray.name`),
holding one file per generation, `gen-000000007.json`; the highest generation is the lease. Taking it
is creating the next generation's file, which only one contender can do: a hard link of a complete
file (atomic on local filesystems and on NFS, which is why not a local `flock`), `O_EXCL` where the
filesystem has no hard links, and on an object store (a URI) a write read back after a pause, the
best such a store offers through pyarrow. The holder renews its file every `renew_s` (a counter and
the time), from a thread.

A contender takes the lease at once when it is free (none yet, or released at a run's end), when its
holder is the same job (a torchrun restart, a Slurm requeue: their job ids say so), or when its holder
is known dead (a process on this host that is gone); it takes it over from a holder whose heartbeat
stopped for longer than the holder's term, or on `run.take_over=true`. It stops with `LeaseHeld`
(one line, exit 2) when it sees the holder renew.

Fencing: a writer whose lease was taken over finds the next generation's file before it publishes a
snapshot or writes a record (one `stat`), publishes nothing, and ends with `Fenced` (exit 2). Between
that check and the rename that publishes there is a window of microseconds; a storage that checked
the generation itself would close it, and none of the filesystems trainapp writes to does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable

from trainapp.errors import ConfigError, Failure
from trainapp.snapshots.lease_store import ArrowStore, DirStore, store_at

if TYPE_CHECKING:
    from trainapp.group import DistContext

log = logging.getLogger(__name__)

_GEN = re.compile(r"^gen-(\d{9})\.json$")
KEEP_GENERATIONS = 3
"""Generation files kept: the holder's and the two before (who held it before, for the reader)."""


class LeaseHeld(ConfigError):
    """Another run holds the run directory: every rank stops before writing anything (exit 2)."""

    everywhere = True  # rank 0's verdict, broadcast: every rank raises it at once


class Fenced(Failure):
    """This run's lease was taken over: it publishes nothing more and ends (exit 2, no record: the run
    directory belongs to the run that took it)."""

    cause = "fenced"
    exit_code = 2


def gen_name(generation: int) -> str:
    return f"gen-{generation:09d}.json"


# ----------------------------------------------------------------------------------------------
# Who holds it


def _proc_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (/proc), which tells a pid reused by
    another process apart; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def job_of(launcher: str) -> str:
    """What makes two processes the same job, whose restarts may take the lease at once: a Slurm job
    (a requeue keeps its id), a torchrun invocation (its restarts keep the run id); anything else is a
    job of its own, this process."""
    if launcher == "slurm" and os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{os.environ['SLURM_JOB_ID']}"
    if launcher == "torchrun" and os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun:{os.environ['TORCHELASTIC_RUN_ID']}"
    return f"{launcher}:{socket.gethostname()}:{os.getpid()}:{_proc_start(os.getpid())}"


def me(launcher: str) -> dict[str, Any]:
    """This process as a lease's holder."""
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "launcher": launcher, "job": job_of(launcher),
              "started_at": round(time.time(), 3), "pid_start": _proc_start(os.getpid()),
              "boot_id": _read("/proc/sys/kernel/random/boot_id"), "pid_ns": _pid_namespace()}
    if launcher == "slurm":  # a requeued job keeps its id: the goodput account tells a requeue by this
        holder["requeue"] = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    return holder


def gone(holder: dict[str, Any]) -> bool:
    """The holder is a process of this host (same boot, same pid namespace) that is no longer running."""
    here = holder.get("boot_id") == _read("/proc/sys/kernel/random/boot_id") != "" and \
        holder.get("pid_ns") == _pid_namespace() and holder.get("host") == socket.gethostname()
    return here and _proc_start(int(holder.get("pid", -1))) != holder.get("pid_start")


def describe(holder: dict[str, Any]) -> str:
    """'torchrun pid 123 on host h (job J) since 2026-11-26 20:01:02 UTC'."""
    since = (datetime.fromtimestamp(holder.get("started_at", 0), timezone.utc)
             .strftime("%Y-%m-%d %H:%M:%S UTC"))
    return (f"{holder.get('launcher', '?')} pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
            f"(job {holder.get('job', '?')}) since {since}")


# ----------------------------------------------------------------------------------------------
# The fence


class Fence:
    """A writer's check that its lease is still its own: the next generation does not exist.
    `generation` 0: no lease (the run
    took none, `run.lease_s=0`): nothing to check."""

    def __init__(self, store: DirStore | ArrowStore | None, generation: int, run_dir: str = "") -> None:
        self.store, self.generation, self.run_dir = store, generation, run_dir
        self.lost_to: dict[str, Any] | None = None
        """The lease that took this one over, once seen."""

    @classmethod
    def none(cls) -> Fence:
        return cls(None, 0)

    def to_dict(self) -> dict[str, Any]:
        """What a Ray worker needs to check the driver's lease (`from_dict`)."""
        return {"run_dir": self.run_dir, "generation": self.generation}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Fence:
        if not d or not d.get("generation"):
            return cls.none()
        return cls(store_at(d["run_dir"]), d["generation"], run_dir=d["run_dir"])

    def lost(self) -> bool:
        """True once another run took the lease over (then for good)."""
        if (self.lost_to is None and self.store is not None
                and self.store.exists(gen_name(self.generation + 1))):
            self.lost_to = parse_record(self.store.read(gen_name(self.generation + 1))) or {}
        return self.lost_to is not None

    def check(self, what: str = "write") -> None:
        """Raise `Fenced` when the lease was taken over, before `what` (a snapshot, a record)."""
        if self.lost():
            raise Fenced(self.line(what))

    def line(self, what: str = "write") -> str:
        holder = describe((self.lost_to or {}).get("holder", {}))
        return (f"run directory {self.run_dir} was taken over by {holder} "
                f"(lease generation {self.generation + 1}; this run's was {self.generation}): "
                f"this run stops before its next {what} and publishes nothing more")


def parse_record(raw: bytes | None) -> dict[str, Any] | None:
    """A JSON object read from the lease folder, None when absent or not (yet) whole."""
    try:
        lease = json.loads(raw) if raw else None
    except ValueError:
        return None
    return lease if isinstance(lease, dict) else None


# ----------------------------------------------------------------------------------------------
# Taking, renewing and releasing it


class Lease:
    """The lease this run holds: `take` it, `start` renewing it, `release` it at the end."""

    def __init__(self, store: DirStore | ArrowStore, run_dir: str, generation: int, record: dict[str, Any],
                 took_over: dict[str, Any] | None) -> None:
        self.store, self.run_dir, self.generation, self.record = store, run_dir, generation, record
        self.took_over = took_over
        """The holder this run took the lease over from, and why (None: it was free or this job's)."""
        self.fence = Fence(store, generation, run_dir=run_dir)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def summary(self) -> dict[str, Any]:
        """For the start record."""
        return {"generation": self.generation, "term_s": self.record["term_s"],
                "holder": self.record["holder"], "took_over": self.took_over}

    @classmethod
    def take(cls, run_dir: str, launcher: str, term_s: float, take_over: bool = False,
             sleep: Callable[[float], None] = time.sleep) -> Lease:
        """Take the lease of `run_dir` for this process (`launcher`: who holds it), waiting while a
        silent holder's term runs out; LeaseHeld when another run holds it and renews it."""
        store, holder = store_at(run_dir), me(launcher)
        try:
            return _Taking(store, run_dir, holder, term_s, take_over, sleep).run()
        except OSError as e:
            raise ConfigError(f"run.dir={run_dir}: cannot take the run's lease in {store.where} "
                              f"({e.strerror or e}); use a directory this user can write, "
                              "or run.lease_s=0 to run without a lease") from None

    def start(self) -> Lease:
        self._thread = threading.Thread(target=self._renew, name="run-lease", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        warned = False
        while not self._stop.wait(self.record["renew_s"]):
            try:
                if self.fence.lost():
                    log.warning("run lease lost: %s", self.fence.line())
                    return
                self._write(renew=True)
                warned = False
            except OSError as e:  # a full disk: training goes on; the term may run out, then fencing stops it
                if not warned:
                    log.warning("run lease %s: cannot renew (%s); another run may take it over after %g s",
                                self.store.where, e, self.record["term_s"])
                warned = True

    def _write(self, renew: bool = False, **changes: Any) -> None:
        with self._lock:  # the renewal thread and a stop request (a signal handler) both write
            renewals = self.record["renewals"] + renew
            self.record = {**self.record, **changes, "renewals": renewals,
                           "renewed_at": round(time.time(), 3)}
            self.store.replace(gen_name(self.generation), json.dumps(self.record).encode())

    def request_stop(self, signal_name: str, by: str) -> None:
        """Ask the run's writers to stop (the holder was told to: `ray job stop`, Ctrl-C): the lease's
        record says so at once, and rank 0 of the run, which reads it (`stop_request`), stops the run at
        the next step with a snapshot. A storage error is raised to the caller."""
        self._write(stop={"signal": signal_name, "by": by, "at": round(time.time(), 3)})

    def release(self) -> None:
        """At the run's end, whatever ended it: the next run takes the lease without waiting. A lease
        taken over is not this run's to release."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            if not self.fence.lost():
                self._write(released=True)


def stop_request(fence: Fence) -> dict[str, Any] | None:
    """The stop the lease of `fence` asks for ({signal, by, at}), None while there is none."""
    if fence.store is None:
        return None
    return (parse_record(fence.store.read(gen_name(fence.generation))) or {}).get("stop")


def _age(record: dict[str, Any]) -> float:
    """Seconds since the lease `record` was last renewed, by this host's clock."""
    return time.time() - float(record.get("renewed_at", 0))


def current(store: DirStore | ArrowStore) -> tuple[int, dict[str, Any] | None]:
    """(generation, record) of the lease in `store`: (0, None) when there is none yet, the record None
    while it is unreadable (being written where there are no hard links)."""
    gens = sorted(int(m.group(1)) for n in store.names() if (m := _GEN.match(n)))
    if not gens:
        return 0, None
    return gens[-1], parse_record(store.read(gen_name(gens[-1])))


def status(run_dir: str) -> str:
    """What the lease of `run_dir` says now, for `trainapp doctor` (no waiting, nothing written)."""
    gen, lease = current(store_at(run_dir))
    if not gen:
        return "free: no run has held it yet"
    if lease is None:
        return f"generation {gen} is being written"
    holder, age = lease.get("holder", {}), _age(lease)
    if lease.get("released"):
        return f"free: released by {describe(holder)}"
    if gone(holder):
        return f"held by {describe(holder)}, whose process is gone: the next run takes it over at once"
    if age > float(lease.get("term_s", 0)):
        return f"held by {describe(holder)}, silent for {age:.0f} s (term {lease.get('term_s')} s): " \
               "the next run takes it over"
    return (f"in use by {describe(holder)}, renewed {age:.1f} s ago: another run started on it now stops "
            "(exit 2)")


class _Taking:
    """One contender's way to the lease (`Lease.take`)."""

    POLL_S = 0.25

    def __init__(self, store: DirStore | ArrowStore, run_dir: str, holder: dict[str, Any], term_s: float,
                 take_over: bool, sleep: Callable[[float], None]) -> None:
        (self.store, self.run_dir, self.holder,
         self.term_s, self.take_over) = store, run_dir, holder, term_s, take_over
        self.sleep = sleep
        self.seen: dict[tuple, float] = {}  # (generation, renewals) -> when this contender first saw it
        self.said = False

    def run(self) -> Lease:
        while True:
            gen, record = current(self.store)
            why = self._why(gen, record or {}) if gen else ("", None)
            if why is None:
                self.sleep(self.POLL_S)
                continue
            took = self._create(gen + 1, why)
            if took is not None:
                return took

    def _why(self, gen: int, record: dict[str, Any]) -> tuple[str, dict | None] | None:
        """('' to take it quietly, or why it is taken over, the old holder); None to wait and look again.
        LeaseHeld when its holder renews it. `record` is {} while the generation is unreadable."""
        now, old = time.monotonic(), record.get("holder", {})
        key = (gen, record.get("renewals"), record.get("released"))
        first_seen = self.seen.setdefault(key, now)
        if record.get("released"):
            return "", None
        if record and old.get("job") == self.holder["job"]:
            log.info("run lease %s: generation %d was this job's (%s): a restart takes it",
                     self.store.where, gen, old.get("job"))
            return "", None
        if record and gone(old):
            return "its process is gone", old
        if self.take_over:
            return "run.take_over=true", old
        if any(k[0] == gen and k != key for k in self.seen):
            raise LeaseHeld(f"run.dir={self.run_dir} is in use by another run: {describe(old)}, "
                            f"lease renewed {_age(record):.1f} s ago; wait for it to end, use another "
                            f"run.dir, or, if that run is dead, rerun with run.take_over=true (a live "
                            f"holder then stops at its next write)")
        term, age, watched = float(record.get("term_s", self.term_s)), _age(record), now - first_seen
        long_enough = watched >= 2 * float(record.get("renew_s", 1.0))  # a live holder renewed meanwhile
        if watched > term or (long_enough and age > term):
            return f"its heartbeat stopped {max(age, watched):.0f} s ago (term {term:g} s)", old
        if long_enough and not self.said:
            self.said = True
            log.warning("run.dir=%s is held by %s, last renewed %.0f s ago; waiting up to %.0f s for it to "
                        "renew (another run: this one stops) or to expire (it is taken over)", self.run_dir,
                        describe(old), age, term)
        return None

    def _create(self, gen: int, why: tuple[str, dict | None]) -> Lease | None:
        reason, old = why
        term = self.term_s
        record = {"generation": gen, "holder": self.holder, "term_s": term, "renew_s": renew_interval(term),
                  "renewals": 0, "renewed_at": round(time.time(), 3), "released": False}
        if not self.store.create(gen_name(gen), json.dumps(record).encode()):
            return None  # another contender took this generation: look again
        for name in self.store.names():
            if (m := _GEN.match(name)) and int(m.group(1)) <= gen - KEEP_GENERATIONS:
                self.store.delete(name)
        took_over = None
        if reason:
            took_over = {"holder": old, "why": reason, "generation": gen - 1}
            log.warning("run.dir=%s: took over the lease of %s: %s (generation %d; that run, if it still "
                        "runs, publishes nothing more)", self.run_dir, describe(old or {}), reason, gen)
        return Lease(self.store, self.run_dir, gen, record, took_over)


def renew_interval(term_s: float) -> float:
    """How often a holder renews: often enough that a contender sees it within seconds, and at least a
    few times within the term."""
    return max(0.1, min(2.0, term_s / 6))


class RunLease:
    """What a rank knows of its run's lease: the `fence` every writer checks, the start record's
    `summary`, and on the holder the `lease` itself, renewed until `release`."""

    def __init__(self, fence: Fence, summary: dict[str, Any] | None = None,
                 lease: Lease | None = None) -> None:
        self.fence, self.summary, self.lease = fence, summary, lease

    @classmethod
    def none(cls) -> RunLease:
        return cls(Fence.none())

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


def take_for_group(ctx: DistContext, run_dir: str, launcher: str, term_s: float, take_over: bool) -> RunLease:
    """Every rank: rank 0 takes the lease of `run_dir` (and renews it from a thread), the others learn
    its generation, so every rank's writes are fenced; LeaseHeld (or the ConfigError of a directory
    where no lease can be taken) on every rank at once. `term_s` 0: no lease."""
    if term_s <= 0:
        return RunLease.none()
    lease: Lease | None = None
    said: dict[str, Any] | None = None
    if ctx.is_main:
        try:
            lease = Lease.take(run_dir, launcher, term_s, take_over).start()
            said = {"generation": lease.generation, "summary": lease.summary()}
        except ConfigError as e:
            said = {"error": str(e)}
    said = ctx.files.broadcast_object(said)
    assert said is not None  # rank 0's, which says one or the other
    if "error" in said:
        raise LeaseHeld(said["error"])
    return RunLease(Fence(store_at(run_dir), said["generation"], run_dir), said["summary"], lease)
