"""The publish step: where a run's snapshots go, what makes a written one count, and how the newest is
found again. It is the one part of snapshots that differs between launchers: `LocalPublish` here
(storage every rank sees; torchrun, Slurm, alone) and Ray Train's in trainapp/launch/ray/publish.py.
Each keeps its own retention: the last `snapshot.keep` here, Ray's checkpoint bookkeeping there.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainapp.errors import ConfigError
from trainapp.snapshots.store import find_shared, list_snapshots, newest_valid, step_of, sweep_leftovers

if TYPE_CHECKING:
    from trainapp.group import DistContext


class Publish:
    """Where snapshots go and what makes one count. The manager writes each one atomically under
    `root` (a local directory) on rank 0, then calls `commit`. A publish step implements `commit`,
    `make_room` and `find`; the other steps default to what storage every rank sees needs: nothing."""

    root: Path
    where: str
    """Where snapshots go, as a message names it (a path or a URI)."""
    setting: str
    """The config key that names that place, for the one line of a storage error."""
    shared_staging: bool
    """A sharded snapshot's shards are written into one directory every rank sees (rank 0's staging
    directory, checked); else each rank's stay on its own disk until `push_shards`."""

    def commit(self, step: int, path: Path) -> Path | str:
        """Rank 0, after the write (in the writer's thread with `snapshot.async`): take the snapshot where
        it goes (an OSError here counts as a failed snapshot) and apply the retention; where it is now."""
        raise NotImplementedError

    def make_room(self) -> int:
        """Rank 0, after ENOSPC: delete older snapshots (never the newest valid one); how many went."""
        raise NotImplementedError

    def find(self, ctx: DistContext) -> tuple[str, dict[str, Any]] | None:
        """(where, state) of the newest valid snapshot, the same on every rank; None to start fresh."""
        raise NotImplementedError

    def newest_step(self, ctx: DistContext) -> int | None:
        """The step of the newest snapshot there, as listed (not read or verified), the same on every rank:
        what the memory tier must be at least as new as. Default: the listing of `root`."""
        steps = [step_of(p.name) for p in list_snapshots(self.root)] if ctx.is_main else []
        newest = max((s for s in steps if s is not None), default=None)
        return ctx.files.broadcast_object(newest)

    def push_shards(self, ctx: DistContext, step: int, tmp: Path, own: list[str]) -> None:
        """Every rank, its shards of `step` written into `tmp` (`own`: the files it wrote, relative to
        `tmp`): take them where the snapshot goes, if `commit` will not (an OSError: a failed snapshot).
        Default: they are in the staging directory every rank sees, published by the rename."""

    def discard(self, step: int) -> None:
        """Rank 0, after a failed sharded snapshot: remove what `push_shards` put where it goes."""

    def put_dir(self, name: str, local: Path) -> Path | str:
        """Rank 0: the directory `local` (under the run directory, e.g. the exported model) put beside the
        snapshots as `name`; where it is now (an OSError: it could not be). Default: the run directory is
        where the snapshots' directory is, so it is there already."""
        return local

    def announce(self, ctx: DistContext, report: dict[str, Any], urgent: bool) -> None:
        """Every rank, after each snapshot is written (or its background write started): make it known
        where the launcher needs it; `urgent` (the same on every rank): at once. Default: the rename
        published it; the other ranks waited for rank 0's verdict in the manager."""

    def flush(self, ctx: DistContext) -> None:
        """Every rank, once the last write is on storage (the end of a run, a stop): make it count too."""


class LocalPublish(Publish):
    """Snapshots in `root` (`run.dir/snapshots`) on storage every rank sees (one machine, NFS, a
    ReadWriteMany volume): the atomic rename publishes, the last `keep` stay."""

    setting = "run.dir"
    shared_staging = True

    def __init__(self, root: Path, keep: int) -> None:
        self.root, self.keep = Path(root), keep
        self.where = str(self.root)

    def commit(self, step: int, path: Path) -> Path:
        snaps = list_snapshots(self.root)
        for old in snaps[: max(0, len(snaps) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        sweep_leftovers(self.root)
        return path

    def make_room(self) -> int:
        try:
            newest = newest_valid(self.root)
        except ConfigError:  # none is valid: none worth keeping
            newest = None
        older = [p for p in list_snapshots(self.root) if newest is None or p != newest[0]]
        for old in older:
            shutil.rmtree(old, ignore_errors=True)
        sweep_leftovers(self.root)
        return len(older)

    def find(self, ctx: DistContext) -> tuple[str, dict[str, Any]] | None:
        return find_shared(ctx, self.root)
