"""The run's final model, exported when training ends (`run.export`): `run.dir/model/`, the artifact
`trainapp export` writes (trainapp/weights/artifact.py), from the model in memory rather than from the
final snapshot, so nothing is read back from storage.

Which model: the EMA copy when the run keeps one (`train.ema_decay` > 0: the weights its evaluation
used), else the model itself; the record says which. A whole model (DDP, alone) is written by rank 0.
A sharded one (FSDP) is written a parameter at a time: every rank takes part in gathering that one
parameter (`full_tensor()`), rank 0 appends it to the file and drops it, so no rank ever holds more
than one whole parameter beyond its own shards. The task's own format (its optional `export(model,
out_dir)`, e.g. Hugging Face's `save_pretrained`) needs the whole model: it runs for a whole model,
and for a sharded one `trainapp export RUN_DIR` writes it from the final snapshot.

The check on the way out: the file is read back with safetensors' own reader and its tensors' digest
compared with the digest of what was written. (`trainapp export` also compares the outputs of a model
loaded from the file with the snapshot's.) Under Ray with a URI store the directory is uploaded beside
the run's snapshots (the publish step's `put_dir`). A storage error here is a warning, not a failed run:
the final snapshot holds the same weights, and `trainapp export` writes them later.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainapp.snapshots.files import is_storage_error
from trainapp.snapshots.store import META
from trainapp.weights.artifact import DTYPE_NAMES, ArtifactDir, plan, versions
from trainapp.weights.safetensors_file import file_digest

if TYPE_CHECKING:
    from trainapp.core.build import Parts
    from trainapp.group import DistContext
    from trainapp.snapshots.manager import SnapshotManager
    from trainapp.weights.safetensors_file import Entry, Writer

log = logging.getLogger("trainapp.core.loop")
DIR = "model"


def export_final(ctx: DistContext, parts: Parts, snapshots: SnapshotManager, run_dir: str,
                 export: bool = True) -> str | None:
    """Every rank, after the final snapshot: the final model exported to `run_dir`/model; where it went
    (rank 0), or None (`export` off: `run.export=false`, another rank, or a storage error, said in one
    warning line)."""
    if not export or not (parts.strategy.sharded or ctx.is_main):
        return None
    t0 = time.perf_counter()
    model = parts.ema.module if parts.ema is not None else parts.model
    state = model.state_dict()
    entries, drop = plan(state, None)
    out = Path(run_dir) / DIR
    try:
        written = _write(ctx, out, entries, state)
        if written is None:
            return None
        artifact, digest = written
        try:
            record = {**_about(run_dir, parts, snapshots), "tensors_sha256": digest, "tied": drop,
                      "check": _check(artifact, digest), "task_export": _task_export(parts, model, artifact)}
            out = artifact.publish(record)
        except BaseException:
            artifact.abort()
            raise
    except OSError as e:
        if not is_storage_error(e):
            raise
        log.warning("the final model was not exported to %s (%s); the final snapshot holds it: "
                    "`trainapp export %s` writes it", out, e, run_dir)
        return None
    where = snapshots.publish.put_dir(DIR, out)
    log.info("model exported: %s (%s, %.2f s)", where,
             "its EMA copy" if parts.ema is not None else "the model", time.perf_counter() - t0)
    return str(where)


def _write(ctx: DistContext, out: Path, entries: list[Entry],
           state: dict[str, torch.Tensor]) -> tuple[ArtifactDir, str] | None:
    """Rank 0: the staging directory with the file written from `state`, and its tensors' digest. One
    tensor at a time; a sharded model's (here on every rank) is gathered whole first, every rank taking
    part in every gather in the same order, also after rank 0 failed to write (it raises once the gathers
    are done)."""
    artifact: ArtifactDir | None = None
    writer: Writer | None = None
    failed: Exception | None = None
    try:
        if ctx.is_main:
            artifact = ArtifactDir(out, force=True, setting="run.dir")
            writer = artifact.writer(entries)
    except Exception as e:
        failed = e
    writer, failed = _gather_into(writer, entries, state, failed)
    if failed is not None or not ctx.is_main:
        if artifact is not None:
            artifact.abort()
        if failed is not None:
            raise failed
        return None
    assert artifact is not None and writer is not None  # rank 0's, and nothing failed
    try:
        return artifact, writer.close()
    except BaseException:
        artifact.abort()
        raise


def _gather_into(writer: Writer | None, entries: list[Entry], state: dict[str, torch.Tensor],
                 failed: Exception | None) -> tuple[Writer | None, Exception | None]:
    """Every rank: each tensor, gathered whole (every rank takes part, in the same order), added to
    rank 0's `writer`; (the writer, None once it failed; the first failure)."""
    for entry in sorted(entries, key=lambda e: e.name):
        t = state[entry.name]
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if writer is not None:
            try:
                writer.add(entry.name, full.detach().to("cpu"))
            except Exception as err:
                writer.abort()
                writer, failed = None, err
        del full
    return writer, failed


def _check(artifact: ArtifactDir, digest: str) -> dict[str, Any]:
    """The file read back with safetensors' reader: its tensors are the ones written."""
    again = file_digest(artifact.file)
    if again != digest:
        raise RuntimeError(f"{artifact.file}: reads back other tensors than were written "
                           f"({again} != {digest})")
    return {"tensors": "read back equal to the trained model's",
            "outputs": "not run (trainapp export runs it)"}


def _task_export(parts: Parts, model: torch.nn.Module, artifact: ArtifactDir) -> str:
    """The task's own format (its optional `export(model, out_dir)`), written beside the file."""
    hook = getattr(parts.task.task, "export", None)
    if not callable(hook):
        return "the task has no export method"
    if parts.strategy.sharded:
        return "not run: the model is sharded (parallel.strategy=fsdp); `trainapp export RUN_DIR` runs it"
    hook(model, artifact.stage)
    return "run"


def _about(run_dir: str, parts: Parts, snapshots: SnapshotManager) -> dict[str, Any]:
    """What the record says the model is and where it came from (the run's config: what its state
    records)."""
    config = parts.state.records["config"]
    step = parts.progress.global_step
    where = snapshots.last_written or snapshots.path_for(step)
    source: dict[str, Any] = {"path": str(where), "step": step,
                              "kind": "sharded snapshot" if parts.strategy.sharded else "snapshot"}
    meta = Path(str(where)) / META
    if meta.is_file():
        info = json.loads(meta.read_text())
        source.update({k: info[k] for k in ("xxh3_128", "params_sha256") if k in info})
    dtype = next((p.dtype for p in parts.model.parameters()), torch.float32)
    return {"run_dir": run_dir, "step": step, "ema": parts.ema is not None, "source": source,
            "dtype": {v: k for k, v in DTYPE_NAMES.items()}.get(dtype, str(dtype)),
            "task": {"name": config["task"]["name"], "args": config["task"]["args"]}, "config": config,
            "init": parts.init, "written_by": "the end of the run", **versions()}
