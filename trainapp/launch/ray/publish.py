"""Where a Ray Train run's snapshots go and where its drain notices come from: `RayPublish`, the
publish step that registers snapshots with Ray as checkpoints, and `RayDrainNotice`, Ray Train's
preemption info as the step boundary's drain notices (trainapp/faults/boundary.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from trainapp.launch.ray.checks import run_store
from trainapp.launch.ray.private.drain import drain_pending
from trainapp.snapshots.publish import Publish
from trainapp.snapshots.store import find_shared, list_snapshots, step_name, step_of, sweep_leftovers

if TYPE_CHECKING:
    from pyarrow.fs import FileSystem

    from trainapp.group import DistContext

log = logging.getLogger(__name__)


class RayPublish(Publish):
    """The publish step of snapshots under Ray Train (trainapp/snapshots/publish.py's protocol):
    `ray.train.report` registers a snapshot with Ray as a checkpoint. A report is a barrier of every
    worker through Ray Train's synchronization actor, so every rank reports at the same snapshots:
    about every `ray.report_interval_s` (rank 0's clock, broadcast in `announce`), and at once for the
    final and the drain snapshots. The directory format is the local one, so one format serves every
    launcher.

    Ray only ever registers a snapshot trainapp has put in place (`NO_UPLOAD`), never uploads one:
    on a filesystem path rank 0 writes it there atomically, as under torchrun (an upload from a local
    directory would write every snapshot twice); to a URI rank 0 writes it locally and uploads it with
    pyarrow, as Ray would. So a failed write or upload is a failed snapshot like a full local disk
    (counted against `snapshot.max_failures`, nothing partial left), not an error inside
    `ray.train.report` that ends the run and leaves the worker's report sequence broken.

    A snapshot written between reports is on storage but unknown to Ray. A restart resumes from the
    newest snapshot on storage all the same (`find` lists the storage, a path or a URI). Rank 0
    deletes each unknown one as soon as a newer one is complete (in the thread that wrote that one),
    and never one Ray knows: Ray deletes those itself (`CheckpointConfig(num_to_keep=snapshot.keep)`),
    and refuses to resume a run whose record names a checkpoint that is gone.

    With `snapshot.async` the write (and upload) runs in the snapshot writer's thread; a report
    registers the newest snapshot complete by then (`flush` the last one, at the end of the run or a
    stop): Ray must not register what is not on storage yet.

    A sharded snapshot (FSDP) to a URI: each rank writes its shards on its own disk and uploads them
    (`push_shards`) before rank 0 writes and uploads the rest (its own shards, state.pt, meta.json
    last of its files to be listed); a failed upload on any rank is a failed snapshot, the store's copy
    deleted (`discard`). A resume downloads the snapshot into a local directory each rank loads its
    shards from, kept until the first snapshot after it.
    """

    setting = "ray.storage_path"

    def __init__(self, run_dir: Path, uri: str | None, async_write: bool, name: str, report_s: float = 0.0):
        self.uri, self.async_write, self.report_s = uri, async_write, report_s
        self.fs: FileSystem | None = None
        # Ray stores the checkpoints as STORAGE/NAME/step_*.
        self.root, self.where = Path(run_dir), str(run_dir)
        if uri is not None:
            self.fs, self.experiment, self.where = run_store(uri, name)
            # Written here first, then uploaded (`commit`).
            self.root = Path(tempfile.gettempdir()) / f"trainapp-snap-{uuid.uuid4().hex[:12]}"
        self.shared_staging = uri is None  # to a URI each rank uploads its own shards
        self.reported_t = time.monotonic()
        self.lock = threading.Lock()
        self.unknown: list[tuple[int, str]] = []
        """Rank 0: (step, where) of the complete snapshots Ray does not know, oldest first (appended by
        whichever thread wrote them)."""
        self.last_metrics: dict[str, Any] = {}
        self.downloads: list[Path] = []
        """Local copies of a URI's sharded snapshot that a resume loads shards from, deleted at the next
        snapshot's announce."""

    def commit(self, step: int, path: Path) -> str:
        sweep_leftovers(self.root)
        where = self._upload(step, path) if self.uri is not None else str(path)
        with self.lock:
            self.unknown.append((step, str(where)))
        self._keep_newest_unknown()  # in the writer's thread with `snapshot.async`, off the training thread
        return where

    def _upload(self, step: int, path: Path) -> str:
        from pyarrow.fs import copy_files

        assert self.fs is not None  # set with `uri`, which is what makes a snapshot an upload
        dest = f"{self.experiment}/{step_name(step)}"
        try:
            self.fs.create_dir(dest)
            copy_files(str(path), dest, destination_filesystem=self.fs)
        except OSError as e:
            self.discard(step)
            raise self._failed(e, step) from None
        finally:
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.root.rmdir()  # the staging directory, empty again
        return dest

    def _failed(self, e: OSError, step: int) -> OSError:
        # pyarrow names no file, and a remote store's errors carry no errno: EIO stands for those.
        why = os.strerror(e.errno) if e.errno else f"upload failed: {str(e).split('. Detail:')[0]}"
        return OSError(e.errno or errno.EIO, why, f"{self.where}/{step_name(step)}")

    def push_shards(self, ctx: DistContext, step: int, tmp: Path, own: list[str]) -> None:
        """Every rank but 0, to a URI: its shard files uploaded into the snapshot's place on the store
        (rank 0's go with the rest in `commit`), then deleted here."""
        if self.uri is None or ctx.is_main:
            return
        from pyarrow.fs import copy_files

        assert self.fs is not None  # set with `uri`
        dest = f"{self.experiment}/{step_name(step)}"
        try:
            for name in own:  # a filesystem store needs the folder made first; an object store ignores it
                self.fs.create_dir(f"{dest}/{name}".rsplit("/", 1)[0])
                copy_files(str(tmp / name), f"{dest}/{name}", destination_filesystem=self.fs)
        except OSError as e:
            raise self._failed(e, step) from None
        finally:
            for name in own:
                with contextlib.suppress(OSError):
                    (tmp / name).unlink()

    def discard(self, step: int) -> None:
        if self.uri is not None:
            assert self.fs is not None  # set with `uri`
            with contextlib.suppress(OSError):
                self.fs.delete_dir(f"{self.experiment}/{step_name(step)}")

    def put_dir(self, name: str, local: Path) -> str:
        """Rank 0: to a URI, the directory `local` uploaded as STORE/NAME/`name` (replacing one there), and
        deleted here; on a filesystem path it is in place already."""
        if self.uri is None:
            return str(local)
        from pyarrow.fs import copy_files

        assert self.fs is not None  # set with `uri`
        dest = f"{self.experiment}/{name}"
        try:
            with contextlib.suppress(OSError):
                self.fs.delete_dir(dest)
            self.fs.create_dir(dest)
            copy_files(str(local), dest, destination_filesystem=self.fs)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        return f"{self.where}/{name}"

    def make_room(self) -> int:
        return self._keep_newest_unknown()  # Ray owns the retention of the snapshots it knows

    def _keep_newest_unknown(self) -> int:
        """Rank 0: deletes the snapshots Ray does not know but the newest; how many."""
        with self.lock:
            doomed, self.unknown = self.unknown[:-1], self.unknown[-1:]
        self._delete(doomed)
        return len(doomed)

    def announce(self, ctx: DistContext, report: dict[str, Any], urgent: bool) -> None:
        """Every rank reports at the same snapshots: at once when `urgent` or `report_s` is 0, else when
        `report_s` has passed on rank 0's clock (its answer broadcast, one small collective a snapshot)."""
        self.last_metrics = report
        while self.downloads:  # the resume that needed them is long done
            shutil.rmtree(self.downloads.pop(), ignore_errors=True)
        due = time.monotonic() - self.reported_t >= self.report_s
        if urgent or self.report_s <= 0 or ctx.broadcast_object(ctx.is_main and due):
            self._report(ctx, report)

    def flush(self, ctx: DistContext) -> None:
        if self.async_write:  # every rank: one more report, registering the last background write
            self._report(ctx, self.last_metrics)

    def _report(self, ctx: DistContext, metrics: dict[str, Any]) -> None:
        """Every rank; rank 0 registers the newest complete snapshot Ray does not know, if any, and
        deletes the older unknown ones after Ray has it."""
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        newest: tuple[int, str] | None = None
        doomed: list[tuple[int, str]] = []
        if ctx.is_main:
            with self.lock:
                if self.unknown:
                    newest, doomed, self.unknown = self.unknown[-1], self.unknown[:-1], []
        ckpt = None
        if newest is not None:
            where = newest[1]
            ckpt = (Checkpoint(where, filesystem=self.fs) if self.fs is not None
                    else Checkpoint.from_directory(where))
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
                         checkpoint_dir_name=step_name(newest[0]) if newest is not None else None)
        self.reported_t = time.monotonic()
        self._delete(doomed)

    def _delete(self, doomed: list[tuple[int, str]]) -> None:
        for step, where in doomed:
            if self.fs is not None:
                with contextlib.suppress(OSError):
                    self.fs.delete_dir(where)
            else:
                shutil.rmtree(where, ignore_errors=True)
            log.debug("snapshot step=%d deleted (newer one on storage; Ray never registered it)", step)

    def _listed(self) -> list[tuple[int, str]]:
        """(step, where) of every snapshot on storage, oldest first."""
        if self.fs is None:
            return [(step, str(p)) for p in list_snapshots(self.root)
                    if (step := step_of(p.name)) is not None]
        from pyarrow.fs import FileSelector, FileType

        infos = self.fs.get_file_info(FileSelector(self.experiment, allow_not_found=True))
        return sorted((step, i.path) for i in infos
                      if i.type == FileType.Directory and (step := step_of(i.base_name)) is not None)

    def _take_unknown(self, listed: list[tuple[int, str]]) -> None:
        """Rank 0: the snapshots newer than Ray's newest, taken as unknown to Ray (a run killed between
        reports left them)."""
        import ray.train

        known = ray.train.get_checkpoint()
        newest_known = step_of(Path(known.path).name) if known is not None else -1
        if newest_known is not None:  # a checkpoint trainapp did not name: take nothing for unknown
            self.unknown = [(step, where) for step, where in listed if step > newest_known]

    def newest_step(self, ctx: DistContext) -> int | None:
        """The newest snapshot's step on storage, as listed (the memory tier resumes a step at least this
        new without reading it); rank 0 takes those Ray does not know, as `find` does."""
        listed = self._listed() if ctx.is_main else []
        if ctx.is_main:
            self._take_unknown(listed)
        return ctx.files.broadcast_object(max((step for step, _ in listed), default=None))

    def find(self, ctx: DistContext) -> tuple[str, dict[str, Any]] | None:
        """The newest valid snapshot on storage (rank 0 chooses, every rank loads it). Rank 0 also takes
        the snapshots newer than Ray's newest as unknown to Ray: a run killed between reports left them."""
        listed: list[tuple[int, str]] = []
        if ctx.is_main:
            listed = self._listed()
            self._take_unknown(listed)
        if self.uri is None:
            return find_shared(ctx, self.root, [Path(where) for _, where in listed])
        return find_shared(ctx, self.where, [where for _, where in listed], local=self._download,
                           keep=self.downloads.append)

    @contextlib.contextmanager
    def _download(self, where: str) -> Iterator[Path]:
        """The snapshot at `where` on the store, as a local directory: deleted after the block unless
        `find_shared` keeps it (a sharded snapshot's shards load from it later)."""
        from pyarrow.fs import copy_files

        local = Path(tempfile.mkdtemp(prefix="trainapp-resume-"))
        try:
            copy_files(where, str(local), source_filesystem=self.fs)
            yield local
        finally:
            if local not in self.downloads:
                shutil.rmtree(local, ignore_errors=True)


class RayDrainNotice:
    """`ray.train.get_preemption_info()` as the loop's drain notice: a description while a node of the
    run is being drained, None otherwise (`new` is true the first time a drain is seen). The call is a
    barrier of every worker through Ray Train's synchronization actor (rank 0's answer, broadcast), so
    every rank calls it at the step the stop vote agreed on, and only once some rank's `pending()`
    says Ray Train's preemption watcher has told it of a drain (a read of the worker's own copy, no
    collective): a run that is never drained pays no barrier, and a drain is asked about at the next
    vote (about every 0.5 s), then about every `preempt.ray_poll_s` while it lasts.
    The loop snapshots at every such answer, so the drained node can die at any moment of its notice
    window and cost at most one poll interval of training; Ray Train then restarts the group from that
    snapshot."""

    def __init__(self) -> None:
        self.seen: tuple | None = None

    def pending(self) -> bool:
        return drain_pending()

    def __call__(self) -> dict[str, Any] | None:
        import ray.train

        info = ray.train.get_preemption_info()
        if info is None:
            return None
        key = (tuple(info.preempted_node_ids), info.deadline_ms)
        new, self.seen = key != self.seen, key
        left = round(info.deadline_ms / 1000 - time.time(), 1) if info.deadline_ms else None
        return {"new": new, "nodes": info.preempted_node_ids, "ranks": info.preempted_ranks,
                "deadline_in_s": left,
                "what": f"Ray node(s) {', '.join(n[:12] for n in info.preempted_node_ids)} drained for "
                        f"preemption (ranks {info.preempted_ranks}, deadline in {left} s)"}
