"""The memory tier of snapshots: every `snapshot.memory_every_steps` steps each rank copies its share of
the run's state into host memory that outlives the training process (slot files under
`snapshot.memory_dir`, a tmpfs: trainapp/snapshots/memory_slots.py), and a restart resumes from there:
no step redone since that copy, no snapshot read from storage.

A restart is one agreement of every rank (`MemoryTier.find`): each rank lists the committed copies its
node holds (its own ranks' and, with a buddy, other nodes' ranks'), every rank learns every list, and the
newest step of which every rank's copy is somewhere is chosen, when it is at least as new as the newest
snapshot on storage. A rank whose copy is on its own node reads it there (`memory`); one whose node lost
it gets it from the rank of the node that holds it (`peer`). Otherwise the storage tier resumes the run,
as without this tier. Copies of another run (its id), another world size or a later step than the one
resumed are deleted, never read.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from trainapp.errors import ConfigError
from trainapp.snapshots import memory_slots as slots
from trainapp.snapshots.memory_peer import PeerLink

if TYPE_CHECKING:
    from trainapp.group import DistContext

log = logging.getLogger(__name__)

NODE_ID = "node-id"
RUN_ID = "memory-id"
OWN, PEER = "own", "peer"
TIER, TIERS, TIER_NOTE = "__tier__", "__tiers__", "__tier_note__"
"""The keys of a resumed state that say which tier it came from (memory, peer; none: storage), the run's
and each rank's, and why copies in memory were not used."""


@dataclass(frozen=True)
class Copy:
    """A committed copy on some node: whose state (`owner` rank), which step, and which file."""

    kind: str
    owner: int
    step: int
    seq: int
    checksum: int
    path: str


@dataclass
class Found:
    """What the agreement resumes: the step, this rank's state, and where it came from."""

    step: int
    state: dict[str, Any]
    tiers: list[str]
    """Where each rank's copy came from: `memory` (its node's) or `peer` (another node's)."""
    seconds: float

    @property
    def tier(self) -> str:
        """The run's: `peer` when some rank's copy came from another node, else `memory`."""
        return "peer" if "peer" in self.tiers else "memory"


def node_id(memory_dir: Path) -> str:
    """This node's memory, named: a random id kept in the memory directory (every process of the node sees
    the same file; a node whose memory was lost gets a new one)."""
    path = memory_dir / NODE_ID
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    tmp = memory_dir / f".{NODE_ID}.{os.getpid()}"
    tmp.write_text(secrets.token_hex(8))
    try:
        os.link(tmp, path)  # the first process of the node wins; the others read its id
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


MEMORY_FS = ("tmpfs", "ramfs")
AUTO_SHARE = 0.02
"""`snapshot.memory_every_steps=auto`: the most of the steps' time the copies may take."""
AUTO_PROBES = 3
"""Copies made every step to measure their cost before `auto` sets the cadence."""
STALE_S = 24 * 3600
"""Another run's copies untouched this long are deleted when a run starts on the node: a run that ended
without finishing (killed for good, its directory gone) would hold that memory forever."""


def default_dir() -> Path:
    return Path(f"/dev/shm/trainapp-{os.getuid()}")


def unusable(memory_dir: Path, made_here: bool) -> str | None:
    """Why `memory_dir` cannot hold the memory tier (missing, not a directory, unwritable, not a memory
    filesystem), or None. The default directory (`made_here`) is made when its parent is there."""
    if made_here and memory_dir.parent.is_dir():
        memory_dir.mkdir(mode=0o700, exist_ok=True)
    if not memory_dir.is_dir():
        return f"{memory_dir} does not exist: make it (a tmpfs) or set snapshot.memory_dir to one"
    if not os.access(memory_dir, os.W_OK | os.X_OK):
        return f"{memory_dir} is not writable by uid {os.getuid()}: fix its mode or set snapshot.memory_dir"
    kind = fs_type(memory_dir)
    if kind not in MEMORY_FS:
        return (f"{memory_dir} is on {kind}, not a memory filesystem (tmpfs): a copy there is a disk write; "
                "point snapshot.memory_dir at a tmpfs such as /dev/shm")
    return None


def fs_type(path: Path) -> str:
    """The filesystem type of the mount that holds `path` (the longest mount point above it)."""
    import psutil

    real = os.path.realpath(path)
    best, kind = "", "unknown"
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip("/") or "/"
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, part.fstype
    return kind


class MemoryTier:
    """One rank's memory tier: its two slot files under `root` (the run's folder in the memory directory),
    written every `every` steps (`auto`: every step for AUTO_PROBES copies, then as their cost allows)."""

    def __init__(self, memory_dir: Path, run_id: str, rank: int, world_size: int, every: int | str):
        self.memory_dir, self.run_id = memory_dir, run_id
        self.root = memory_dir / f"run-{run_id}"
        self.rank, self.world_size = rank, world_size
        self.auto = every == "auto"
        self.every = 1 if self.auto else int(every)
        self.node = node_id(memory_dir)
        self.last_seconds = 0.0
        """Seconds the last copy held training."""
        self.copies = 0
        self.probe_times: list[float] = []
        """`auto`: when each probe copy began (the steps' time is between them)."""
        self.files: list[slots.SlotFile] = []
        """This rank's two slots, open between copies; `target` the one the next copy goes to."""
        self.target = 0
        self.seconds: collections.deque[float] = collections.deque(maxlen=1000)
        """The recent copies' seconds, for the end record."""
        self.note: str | None = None
        """Why the last restart did not resume from memory, when it had copies it could not use."""
        self.link: PeerLink | None = None
        """The buddy copies' threads (`snapshot.memory_peer` on several nodes), once `sized` started them."""
        self.midway: Callable[[int], None] | None = None
        """Called with the step halfway through each copy (a drill's kill, trainapp/faults/drills.py)."""

    @classmethod
    def from_config(cls, every: int | str, memory_dir: str, run_dir: str, ctx: DistContext,
                    given_id: str | None = None) -> MemoryTier | None:
        """Every rank: the rank's memory tier (None: off). A memory directory that cannot hold it on some
        rank's node is one ConfigError on every rank when the cadence was set, and off (one warning line)
        for `auto`."""
        if every == 0:
            return None
        where = Path(memory_dir) if memory_dir else default_dir()
        problems = ctx.files.all_gather_objects(unusable(where, made_here=not memory_dir))
        problem = next((f"rank {r}: {p}" for r, p in enumerate(problems) if p), None)
        if problem is not None:
            if every != "auto":
                raise ConfigError(f"snapshot.memory_every_steps={every}: {problem}")
            if ctx.is_main:
                log.warning("snapshot.memory_every_steps=auto: the memory tier is off (%s)", problem)
            return None
        _prune(where, time.time() - STALE_S)
        return cls(where, given_id or _run_id(run_dir, ctx), ctx.rank, ctx.world_size, every)

    def sized(self, ctx: DistContext, state_bytes: int, peer: bool) -> MemoryTier | None:
        """Every rank, once the parts are built: this tier if every node's memory directory holds two
        copies of each of its ranks' shares (and two of a buddy's with `peer` on several nodes); else
        ConfigError (a cadence that was set) or None (`auto`, one warning line). Both with the numbers."""
        free = shutil.disk_usage(self.memory_dir).free
        nodes = ctx.files.all_gather_objects((self.node, state_bytes, free))
        short = _shortfall(self.memory_dir, nodes, peer)
        if short is None:
            # Made only now: a run that stops before its first step (bad input, a state no snapshot could
            # load back) leaves no empty folder behind in the node's memory.
            self.root.mkdir(parents=True, exist_ok=True)
            self.link = PeerLink.start(ctx, self.root, [n for n, _, _ in nodes]) if peer else None
            return self
        fix = ("give it more memory (docker run --shm-size, a Kubernetes emptyDir with medium: Memory and a "
               "sizeLimit) or set snapshot.memory_dir to a larger tmpfs")
        if not self.auto:
            raise ConfigError(f"snapshot.memory_every_steps={self.every}: {short}; {fix}")
        if ctx.is_main:
            log.warning("snapshot.memory_every_steps=auto: the memory tier is off: %s; %s", short, fix)
        return None

    def _own(self, owner: int, slot: int) -> Path:
        return self.root / f"{OWN}-{owner:05d}.{slot}"

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, ctx: DistContext, step: int, state: dict[str, Any]) -> None:
        """This rank's `state` of `step` into its older slot (the newer one stays whole meanwhile); with
        `auto`, after the probe copies, the cadence set by rank 0's costs (a broadcast of every rank)."""
        t0 = time.perf_counter()
        self._write(step, state)
        if self.auto:
            self.probe_times.append(t0)
            if len(self.probe_times) == AUTO_PROBES:
                self.every = ctx.files.broadcast_object(self._cadence())
                self.auto = False
                if ctx.is_main:
                    log.info("snapshot.memory_every_steps=auto: a copy every %d step(s) (a copy %.1f ms)",
                             self.every, 1e3 * sorted(self.seconds)[len(self.seconds) // 2])

    def _cadence(self) -> int:
        """The fewest steps between copies that keep a copy at AUTO_SHARE of the steps' time (the probes are
        this process's only copies so far: `seconds` holds their costs)."""
        cost = sorted(self.seconds)[len(self.seconds) // 2]
        gaps = [b - a for a, b in zip(self.probe_times, self.probe_times[1:])]
        step = max(sorted(gaps)[len(gaps) // 2] - cost, 1e-6) if gaps else 1.0
        return max(1, math.ceil(cost / (AUTO_SHARE * step)))

    def _write(self, step: int, state: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        if not self.files:
            try:
                self.files = [slots.SlotFile(self._own(self.rank, k)) for k in (0, 1)]
            except FileNotFoundError:
                # The run's folder was deleted from outside the run (a /dev/shm wiped by hand or by a
                # cleaner): made again, so the copies go on; what it held is gone, as a lost node's is.
                log.warning("memory tier: %s was deleted while the run used it; made again", self.root)
                self.root.mkdir(parents=True, exist_ok=True)
                self.files = [slots.SlotFile(self._own(self.rank, k)) for k in (0, 1)]
            seqs = [f.seq for f in self.files]
            self.target = seqs.index(min(seqs))  # the older slot, or one that holds nothing whole
        hook = self.midway
        midway = functools.partial(hook, step) if hook is not None else None
        copy = {"run": self.run_id, "rank": self.rank, "world_size": self.world_size, "step": step,
                "state": state}
        slot = self.files[self.target].write(copy, seq=step, step=step, midway=midway)
        self.target = 1 - self.target  # the other one is the older from now on
        if self.link is not None:
            self.link.send(slot)  # to the buddy, in the background
        self.copies += 1
        self.last_seconds = time.perf_counter() - t0
        self.seconds.append(self.last_seconds)

    def inventory(self) -> list[Copy]:
        """The committed copies of this run on this node (any owner), newest first per owner."""
        out = []
        for path in sorted(self.root.glob("*-*.[01]")):
            kind, _, rest = path.name.partition("-")
            head = slots.header(path)
            if head is None or kind not in (OWN, PEER):
                continue
            out.append(Copy(kind, int(rest.split(".")[0]), head.step, head.seq, head.checksum, str(path)))
        return out

    def find(self, ctx: DistContext, storage_step: int | None) -> Found | None:
        """Every rank: the newest step every rank's copy is on some node for, when it is at least
        `storage_step` (the newest snapshot on storage, None without one); each rank's state of it, read
        here or sent by the rank of the node that holds it. None (to resume from storage) otherwise."""
        t0 = time.perf_counter()
        side = ctx.files
        everyone = side.all_gather_objects((self.node, self.inventory()))
        step, plan = _choose(everyone, self.world_size, storage_step)
        if step is None:
            self._drop_after(-1 if storage_step is None else storage_step)
            return None
        state, why = self._check(_transfer(side, plan, self.rank), step)
        reasons = side.all_gather_objects(why)
        if any(reasons):
            self.note = next(f"rank {r}'s copy of step {step} {w}" for r, w in enumerate(reasons) if w)
            if ctx.is_main:
                log.warning("memory tier: %s; resuming from storage", self.note)
            self._drop_after(-1)
            return None
        assert state is not None
        self._drop_after(step)
        return Found(step, state, [how for _, _, _, how in plan], time.perf_counter() - t0)

    def _check(self, data: bytes | None, step: int) -> tuple[dict[str, Any] | None, str | None]:
        """(this rank's state, None), or (None, why the copy cannot resume this run)."""
        if data is None or not slots.check(data):
            return None, "was not whole"
        got = slots.decode(data)
        if got.get("world_size") != self.world_size:
            return None, (f"is of world size {got.get('world_size')}, this run's is {self.world_size} (a "
                          "resize: storage resumes it)")
        if (got.get("run"), got.get("rank"), got.get("step")) != (self.run_id, self.rank, step):
            return None, "is another run's or rank's"
        return got["state"], None

    def recover(self, ctx: DistContext, storage_newest: int | None,
                storage: Callable[[DistContext], tuple[str, dict[str, Any]] | None],
                ) -> tuple[str, dict[str, Any]] | None:
        """Every rank: (where, this rank's share of the state) from memory when `find` agrees on a step at
        least as new as storage's newest (`storage_newest`), else what `storage` loads."""
        found = self.find(ctx, storage_newest)
        if found is None:
            hit = storage(ctx)
            return (hit[0], {**hit[1], TIER_NOTE: self.note}) if hit is not None and self.note else hit
        if ctx.is_main:
            log.info("memory tier: resuming step %d from memory (%s) in %.2f s", found.step, found.tier,
                     found.seconds)
        return f"memory:step_{found.step:09d}", {**found.state, TIER: found.tier, TIERS: found.tiers}

    def _drop_after(self, step: int) -> None:
        """Copies of steps after `step` on this node: another timeline's from now on (this run resumes at
        `step`), never to be read."""
        for copy in self.inventory():
            if copy.step > step:
                Path(copy.path).unlink(missing_ok=True)

    def summary(self) -> dict[str, Any]:
        """For the end record: the copies made, the cadence, a copy's median milliseconds."""
        ms = sorted(self.seconds)
        return {"copies": self.copies, "every_steps": self.every,
                "copy_ms": round(1e3 * ms[len(ms) // 2], 3) if ms else None,
                "buddy": self.link.buddy[0] if self.link is not None and self.link.buddy else None}

    def close(self, finished: bool) -> None:
        """At the run's end: a finished (or stopped for good) run's copies are deleted on this node."""
        for f in self.files:
            f.close()
        self.files = []
        if self.link is not None:
            self.link.close()
        if finished:
            shutil.rmtree(self.root, ignore_errors=True)


def _choose(everyone: list[tuple[str, list[Copy]]], world_size: int,
            storage_step: int | None) -> tuple[int | None, list[tuple[int, int, str, str]]]:
    """The step to resume from memory (None: storage) and the plan: (owner, holder rank, path, tier) for
    every owner. A copy on the owner's own node is read there; else the lowest rank of the holding node
    sends it."""
    nodes = [node for node, _ in everyone]
    holders: dict[tuple[int, int], list[tuple[str, str]]] = {}  # (owner, step) -> [(node, path)]
    seen: set[tuple[str, str]] = set()
    for node, copies in everyone:
        for c in copies:
            if (node, c.path) in seen or c.owner >= world_size:
                continue
            seen.add((node, c.path))
            holders.setdefault((c.owner, c.step), []).append((node, c.path))
    steps = sorted({s for (_, s) in holders}, reverse=True)
    for step in steps:
        if storage_step is not None and step < storage_step:
            break
        if all((r, step) in holders for r in range(world_size)):
            plan = []
            for r in range(world_size):
                at = holders[(r, step)]
                here = [p for n, p in at if n == nodes[r]]
                if here:
                    plan.append((r, r, here[0], "memory"))
                else:
                    node, path = at[0]
                    plan.append((r, nodes.index(node), path, "peer"))
            return step, plan
    return None, []


def _transfer(side: DistContext, plan: list[tuple[int, int, str, str]], rank: int) -> bytes | None:
    """This rank's copy by the plan: read from its node, or sent by its holder (point to point, every pair
    in the plan's order on every rank)."""
    mine = b""
    for owner, holder, path, _ in plan:
        if owner == holder:
            if owner == rank:
                mine = slots.read_raw(path)
            continue
        if rank == holder:
            _send(side, slots.read_raw(path) or b"", owner)
        elif rank == owner:
            mine = _recv(side, holder)
    return mine or None




def _send(side: DistContext, data: bytes, dst: int) -> None:
    import torch.distributed as dist

    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=side.group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=side.group)


def _recv(side: DistContext, src: int) -> bytes:
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=side.group)
    if not int(size.item()):
        return b""
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(buf, src, group=side.group)
    return buf.numpy().tobytes()


def _run_id(run_dir: str, ctx: DistContext) -> str:
    """The run's id (`run_id`), read by the main rank and given to every rank."""
    return ctx.files.broadcast_object(run_id(run_dir) if ctx.is_main else None) or ""


def run_id(run_dir: str) -> str:
    """The run's id, kept in its run directory (made at its first start): copies in memory under another id
    are another run's, even one in a run directory of the same name. The file also names the directory it
    was made in: a run directory copied (`cp -r`) while the original is still there gets an id of its own,
    so the copy never resumes from the original's copies in memory; one moved keeps its id."""
    here = os.path.realpath(run_dir)
    path = Path(here) / RUN_ID
    try:
        rid, _, made_in = path.read_text().strip().partition("\n")
    except FileNotFoundError:
        return _new_run_id(path, here)
    if made_in and made_in != here:
        try:
            original = (Path(made_in) / RUN_ID).read_text().strip().partition("\n")[0]
        except OSError:  # moved, or another node's path for the same shared directory
            original = ""
        if original == rid:
            log.info("run.dir=%s is a copy of %s: its copies in memory are that run's; this run keeps "
                     "its own", here, made_in)
            return _new_run_id(path, here)
    return rid


def _new_run_id(path: Path, made_in: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RUN_ID}.{os.getpid()}")
    tmp.write_text(f"{secrets.token_hex(8)}\n{made_in}\n")
    os.replace(tmp, path)
    return path.read_text().strip().partition("\n")[0]


def _shortfall(memory_dir: Path, nodes: list[tuple[str, int, int]], peer: bool) -> str | None:
    """What a node's memory directory lacks to hold its ranks' copies ((node, state bytes, free bytes) of
    every rank), or None."""
    copies = 4 if peer and len({n for n, _, _ in nodes}) > 1 else 2
    for node, _, free in nodes:
        ranks = [b for n, b, _ in nodes if n == node]
        need = sum(ranks) * copies
        if need > free:
            return (f"{memory_dir} has {free / 2**20:.1f} MiB free on node {node}, and the memory tier needs "
                    f"{need / 2**20:.1f} MiB there ({copies} copies of each of its {len(ranks)} rank(s)' "
                    f"{max(ranks) / 2**20:.1f} MiB share of the state"
                    f"{', 2 of them a buddy' if copies == 4 else ''})")
    return None


def _prune(memory_dir: Path, before: float) -> None:
    """Delete the run folders in `memory_dir` whose every file was last written before `before`."""
    for run in memory_dir.glob("run-*"):
        try:
            newest = max([run.stat().st_mtime, *(f.stat().st_mtime for f in run.iterdir())])
        except OSError:  # another process deleted it meanwhile
            continue
        if newest < before:
            shutil.rmtree(run, ignore_errors=True)
