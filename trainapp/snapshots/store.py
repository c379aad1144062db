"""The snapshot directory: its format, its atomic write, and finding the newest valid one again.

A snapshot is a directory `step_000000123/` holding `state.pt` (everything needed to continue exactly)
and `meta.json` (step, epoch, world size, the checksum and size of state.pt). It is written under a
temporary name, every file fsynced, `meta.json` last, then renamed into place: a directory with that
name is complete by construction. On load the checksum is verified, and a corrupt or truncated
snapshot is reported and skipped in favour of the previous one. A process killed mid-write leaves a
`.tmp-*` directory, never a `step_*` one (`sweep_leftovers` removes it later).

The same directory is what Ray Train stores as a checkpoint, so one format serves every launcher.

A sharded snapshot (an FSDP run, `parallel.strategy=fsdp`) also holds `shards/`: every rank's shard of
the model and optimizer as torch.distributed.checkpoint writes them (`__R_0.distcp` per rank, and
`.metadata`), written into the same temporary directory first (`write_shards`, every rank), each file
checksummed by the rank that wrote it; `meta.json` lists every shard file with its size and checksum,
so a torn or flipped shard makes the whole snapshot invalid, and it is renamed into place as a whole.
That directory must be one every rank sees (`check_seen`, before any shard is written).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence, overload

import torch

from trainapp.errors import ConfigError, Failure
from trainapp.snapshots.files import (
    CHECKSUMS,
    Buffers,
    file_digest,
    fsync_dir,
    replace_dir,
    save_state,
    write_bytes,
)

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp

    from trainapp.group import DistContext

    Saved = dict[str, tuple[torch.Size, torch.dtype] | None]
    """A sharded part's entries by name (`sharded_part`)."""

log = logging.getLogger(__name__)

# torch.distributed.checkpoint in a process without a process group (a sharded snapshot resumed alone,
# or read by `trainapp inspect`) says it assumes one process, which it is.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STATE, META, SHARDS = "state.pt", "meta.json", "shards"
SHARDED = "sharded"
LOCAL_COPY = "local_copy"
"""The key `find_shared` adds to a downloaded sharded snapshot's state: the local directory its shards
load from (they load after `find`, into the parts it builds)."""
"""A part's entry in state.pt when its state is in the snapshot's shards (trainapp/core/state.py)."""
FORMAT = 2
_NAME = re.compile(r"^step_(\d{9})$")


class SnapshotError(Failure):
    """A snapshot that cannot be used (missing file, bad checksum, unreadable): bad input, exit 2."""

    cause = ""
    exit_code = 2


def step_name(step: int) -> str:
    """The directory name of the snapshot of `step` (`step_000000123`), on every kind of storage."""
    return f"step_{step:09d}"


def step_of(name: str) -> int | None:
    """The step a snapshot directory's name stands for (`step_000000123`: 123); None for other names."""
    return int(m.group(1)) if (m := _NAME.match(name)) else None


def tensors_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the raw bytes of every tensor, in sorted key order."""
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().to("cpu").contiguous().reshape(-1)
        # The buffer itself: no copy of a large tensor. (numpy's stubs declare ndarray's buffer protocol
        # for Python 3.12 and later only.)
        h.update(t.view(torch.uint8).numpy())  # type: ignore[arg-type]
    return h.hexdigest()


def params_sha256(module: torch.nn.Module) -> str:
    """sha256 over a model's parameters and buffers (its state_dict), in sorted name order."""
    return tensors_sha256(module.state_dict())


def staging(final: Path) -> Path:
    """The temporary directory a snapshot of `final` is written in before the rename publishes it."""
    return final.parent / f".tmp-{final.name}-{os.getpid()}"


def check_seen(ctx: DistContext, tmp: Path, setting: str, where: str) -> None:
    """Every rank, before its shards go into rank 0's staging directory `tmp`: ConfigError on every rank
    when some rank does not see it (storage local to each node). torch.distributed.checkpoint would
    create the directory on that rank's own disk and write its shard there, and rank 0 would publish a
    snapshot whose shards it does not hold, found out only by the resume that needs them."""
    end = time.monotonic() + 2.0
    while not tmp.is_dir() and time.monotonic() < end:  # a network filesystem's client may lag a moment
        time.sleep(0.1)
    blind = [who for who in ctx.files.all_gather_objects(None if tmp.is_dir() else f"rank {ctx.rank} on "
                                                   f"{os.uname().nodename}") if who]
    if blind:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"{where}: not the same directory on every node ({', '.join(blind)} cannot see "
                          f"rank 0's snapshot directory {tmp.name}); sharded snapshots "
                          f"(parallel.strategy=fsdp) need storage every node sees: point {setting} at a "
                          f"shared filesystem (NFS, a shared volume)")


class Disk:
    """What a snapshot's write goes through on its way to storage: the seam a failure drill wraps
    (trainapp/faults/drills.py). This one adds nothing to the write."""

    def before_meta(self, progress: Callable[[], None]) -> None:
        """Rank 0, a snapshot without shards: between its state file and the meta file that completes
        it (`progress`: the hang watchdog's beat)."""

    def shard_writer(self, writer: dcp.FileSystemWriter, shards: dict[str, Any]) -> dcp.FileSystemWriter:
        """Every rank: DCP's `writer` of this rank's `shards`, as this disk writes them."""
        return writer


def write_shards(tmp: Path, shards: dict[str, Any], disk: Disk = Disk()) -> None:
    """Every rank: write this rank's shards into `tmp/shards` (torch.distributed.checkpoint, a
    collective; every file fsynced); `own_shards` then lists them."""
    import torch.distributed.checkpoint as dcp

    dcp.save(shards, storage_writer=_shard_writer(tmp, shards, disk))


def _shard_writer(tmp: Path, shards: dict[str, Any], disk: Disk) -> dcp.FileSystemWriter:
    """DCP's writer into `tmp/shards`, every file fsynced, through `disk`."""
    import torch.distributed.checkpoint as dcp

    return disk.shard_writer(dcp.FileSystemWriter(str(tmp / SHARDS), sync_files=True), shards)


def start_shards(tmp: Path, shards: dict[str, Any], group: Any, disk: Disk = Disk()) -> Any:
    """Every rank: `write_shards`' write, asynchronous (DCP's `async_save`): the shards are copied to CPU
    memory now, written by a thread of DCP's that talks to the other ranks over `group` (a group of its
    own, so its collectives never interleave with training's). A future; `own_shards` once it is done."""
    import torch.distributed.checkpoint as dcp

    started = dcp.async_save(shards, storage_writer=_shard_writer(tmp, shards, disk), process_group=group)
    return getattr(started, "upload_completion", started)  # a future, or a response holding it


def own_shards(ctx: DistContext, tmp: Path) -> dict[str, dict[str, Any]]:
    """Every rank, its shards written: {file: {"xxh3_128", "bytes"}} of the files this rank wrote (rank 0
    also the metadata), each fsynced first."""
    own: dict[str, dict[str, Any]] = {}
    for path in sorted((tmp / SHARDS).iterdir()):
        if path.name.startswith(f"__{ctx.rank}_") or (ctx.is_main and not path.name.startswith("__")):
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            own[f"{SHARDS}/{path.name}"] = {"xxh3_128": file_digest(path), "bytes": path.stat().st_size}
    return own


def merged(everyone: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """Rank 0: every rank's `own_shards` as one listing (None elsewhere)."""
    return {k: v for part in everyone for k, v in part.items()} if everyone is not None else None


def write_dir(final: Path, state: dict[str, Any], meta: dict[str, Any], disk: Disk = Disk(),
              progress: Callable[[], None] = lambda: None, buffers: Buffers | None = None,
              before_publish: Callable[[], None] = lambda: None,
              shards: dict[str, Any] | None = None) -> Path:
    """Write `state` and `meta` as the snapshot directory `final`, atomically (`disk`: what the write
    goes through, a drill's slow disk; `progress`: called as the write goes, for the hang watchdog;
    `before_publish`: the last word before the rename, which may raise to publish nothing: the lease's
    fence; `shards`: the shard files already in the staging directory, `write_shards`' listing)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging(final)
    if shards is None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    try:
        digest, size = save_state(tmp / STATE, state, progress, buffers)
        if shards is None:  # with shards, `disk` wrote them (`shard_writer`)
            disk.before_meta(progress)
        meta = {**meta, "format": FORMAT, "xxh3_128": digest, "bytes": size,
                **({SHARDS: shards} if shards else {})}
        write_bytes(tmp / META, lambda f: f.write(json.dumps(meta, indent=2).encode()))
        fsync_dir(tmp)
        before_publish()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return replace_dir(tmp, final)  # the same step written again: a run resumed from its final snapshot


def read_meta(snap: Path) -> dict[str, Any]:
    try:
        meta = json.loads((snap / META).read_text())
    except FileNotFoundError:
        raise SnapshotError(f"{snap}: no {META} (incomplete snapshot)") from None
    except (OSError, ValueError) as e:
        raise SnapshotError(f"{snap}/{META}: unreadable ({e})") from None
    if not isinstance(meta, dict) or not any(k in meta for k in CHECKSUMS):
        raise SnapshotError(f"{snap}/{META}: not a trainapp snapshot record")
    return meta


def verify(snap: Path) -> dict[str, Any]:
    """Meta of a complete, intact snapshot; SnapshotError saying what is wrong otherwise."""
    meta = read_meta(snap)
    state = snap / STATE
    if not state.is_file():
        raise SnapshotError(f"{state}: missing")
    size = state.stat().st_size
    if size != meta.get("bytes"):
        raise SnapshotError(f"{state}: {size} bytes, expected {meta.get('bytes')} (truncated?)")
    algo = next(k for k in CHECKSUMS if k in meta)
    if file_digest(state, algo) != meta[algo]:
        raise SnapshotError(f"{state}: checksum mismatch ({algo}; corrupt)")
    for name, want in (meta.get(SHARDS) or {}).items():
        path = snap / name
        if not path.is_file():
            raise SnapshotError(f"{path}: missing (a shard of this snapshot)")
        if path.stat().st_size != want["bytes"]:
            raise SnapshotError(f"{path}: {path.stat().st_size} bytes, expected {want['bytes']} "
                                "(a torn shard)")
        if file_digest(path) != want["xxh3_128"]:
            raise SnapshotError(f"{path}: checksum mismatch (xxh3_128; a corrupt shard)")
    return meta


def load_state(snap: Path, name: str = STATE) -> dict[str, Any]:
    """Every rank loads to CPU first, then moves what it needs to its own device."""
    try:
        state = torch.load(snap / name, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise SnapshotError(f"{snap / name}: cannot be loaded as a snapshot "
                            f"({e.__class__.__name__}: {first})") from None
    if not isinstance(state, dict) or state.get("model") is None:
        raise SnapshotError(f"{snap / name}: not a trainapp snapshot (no model state)")
    return state


def sharded_part(snap: Path, part: str) -> Saved:
    """The model state of `part` in a sharded snapshot's shards (DCP keys PART.model.NAME), by NAME: each
    tensor's (shape, dtype), None for a non-tensor entry. Read from the shards' metadata alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{part}.model."
    return {key[len(prefix):]: ((saved.size, saved.properties.dtype)
                                if isinstance(saved, TensorStorageMetadata) else None)
            for key, saved in dcp.FileSystemReader(str(snap / SHARDS)).read_metadata()
            .state_dict_metadata.items() if key.startswith(prefix)}


def read_sharded(snap: Path, part: str, saved: Saved) -> dict[str, Any]:
    """The entries `saved` (of `sharded_part`) of `part`'s model, read from every rank's shard in this one
    process straight into tensors of the saved shapes: nothing else is read, nothing is written."""
    import torch.distributed.checkpoint as dcp

    model: dict[str, Any] = {name: None if kind is None else torch.empty(tuple(kind[0]), dtype=kind[1])
                             for name, kind in saved.items()}  # a non-tensor is read into its placeholder
    dcp.load({part: {"model": model}}, storage_reader=dcp.FileSystemReader(str(snap / SHARDS)), no_dist=True)
    return model


def full_sharded_model(snap: Path, name: str = "model") -> dict[str, Any]:
    """The whole model state of a sharded snapshot (part `name`), not the optimizer's, and no temporary
    copy (which would need the whole state's size free in the temp directory)."""
    return read_sharded(snap, name, sharded_part(snap, name))


def list_snapshots(root: Path) -> list[Path]:
    """Snapshot directories under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))


@overload
def newest_valid(root: Path | str, snaps: None = None,
                 local: Callable[[Any], ContextManager[Path | str]] = ...,
                 ) -> tuple[Path, dict[str, Any]] | None:
    ...


@overload
def newest_valid(root: Path | str, snaps: Sequence[Path | str],
                 local: Callable[[Any], ContextManager[Path | str]] = ...,
                 ) -> tuple[Path | str, dict[str, Any]] | None:
    ...


def newest_valid(root: Path | str, snaps: Sequence[Path | str] | None = None,
                 # `local` takes an element of `snaps` (a Ray store's takes URI strings only): Any.
                 local: Callable[[Any], ContextManager[Path | str]] = contextlib.nullcontext,
                 ) -> tuple[Path | str, dict[str, Any]] | None:
    """(snapshot, meta) of the newest of `snaps` (oldest first; default: those under `root`) that
    verifies, warning about each newer one that does not; `local(snap)`: a context that gives it as a
    local directory (a download, for a URI). Raises ConfigError when snapshots exist but none is
    usable: starting over silently would hide the problem, and the user may want to inspect them."""
    snaps = list_snapshots(Path(root)) if snaps is None else snaps
    problems = []
    for snap in reversed(snaps):
        try:
            with local(snap) as d:
                return snap, verify(Path(d))
        except SnapshotError as e:
            problems.append(str(e))
            log.warning("skipping snapshot: %s; falling back to the previous one", e)
    if snaps:
        raise ConfigError(f"{root}: {len(snaps)} snapshot(s) but none is valid ({problems[0]}); "
                          "move them away to start over")
    return None


def resolve(path: str | Path) -> Path:
    """A snapshot directory from a snapshot file, a snapshot dir, a snapshots dir or a run dir."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: no such file or directory; pass a snapshot, a snapshots/ dir or a run dir")
    if p.is_file():
        p = p.parent
    if (p / META).exists() or (p / STATE).exists():
        return p
    for candidate in (p / "snapshots", p):
        if list_snapshots(candidate):
            found = newest_valid(candidate)
            if found:
                return found[0]
    raise ConfigError(f"{p}: holds no snapshot (expected {STATE} + {META}, a snapshots/ dir or step_* dirs)")


def find_shared(ctx: DistContext, root: Path | str, snaps: Sequence[Path | str] | None = None,
                local: Callable[[Any], ContextManager[Path | str]] = contextlib.nullcontext,
                keep: Callable[[Path], None] | None = None) -> tuple[str, dict[str, Any]] | None:
    """(path, state) of the newest valid snapshot under `root` (`snaps`, `local`: as `newest_valid`; on
    rank 0), on storage every rank sees: rank 0 chooses, every rank loads that one. None to start fresh.
    `keep(d)`: told of a download `d` of a sharded snapshot, whose shards load later from it (the state's
    LOCAL_COPY), so that `local` does not delete it yet."""
    hit = newest_valid(root, snaps, local) if ctx.is_main else None
    found = ctx.files.broadcast_object(str(hit[0]) if hit else None)
    if found is None:
        return None
    try:
        with local(found) as d:
            state = load_state(Path(d))
            if keep is not None and Path(d) != Path(found) and any(isinstance(v, str) and v == SHARDED
                                                                  for v in state.values()):
                keep(Path(d))
                state[LOCAL_COPY] = str(d)
            return found, state
    except FileNotFoundError:
        raise ConfigError(
            f"{root}: rank {ctx.rank} on {os.uname().nodename} cannot see snapshot {found} that rank 0 "
            "chose; the run directory must be storage every node sees") from None


def sweep_leftovers(root: Path) -> None:
    """Remove what writers that died left under `root` (`.tmp-*`): one write at a time, and it just ended."""
    for leftover in root.glob(".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
