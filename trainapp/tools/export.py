"""`trainapp export` and `trainapp.load_model`: a run's model out as a file that loads anywhere, and back in.

    trainapp export RUN_DIR --out DIR [--step N] [--ema] [--dtype fp32|bf16|fp16] [--no-check] [--force]

One CPU process, no process group, no GPU, no Ray: the snapshot (the newest valid one, as a resume
would choose it, or `--step`) is read into a fresh model of the run's task (its `trainapp.json` config:
`task.name`, `task.args`), whole or from the shards of an FSDP run at any world size; `DIR/model.safetensors`
is written from it a tensor at a time, under the names of the user's own module (tied weights once),
then `DIR/trainapp.json`, and the task's own format if it has an `export(model, out_dir)` method.

The check on the way out: the model is freed, a second fresh model is loaded from the file with
safetensors' `load_model` (strict), and its outputs on a validation batch (the tensors its forward
returns, and the task's `evaluate` sums) are compared with the snapshot's model's: equal in fp32, within
a relative error for bf16/fp16. Its result goes in `trainapp.json`; a failed check publishes nothing.
At most one model is in memory at a time (peak RSS measured in bench/export.py).
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from trainapp.config import ConfigError, from_dict
from trainapp.core.items import Items
from trainapp.core.task import BoundTask, bind
from trainapp.errors import Failure
from trainapp.group import DistContext
from trainapp.snapshots.store import tensors_sha256
from trainapp.streams.api import is_stream
from trainapp.weights import init
from trainapp.weights.artifact import DTYPE_NAMES, ArtifactDir, plan, versions, write_state
from trainapp.weights.safetensors_file import file_digest
from trainapp.weights.sources import Source, open_source

log = logging.getLogger("trainapp.export")
TOLERANCE = MappingProxyType({"bf16": 0.05, "fp16": 0.01})
"""Relative L2 error of the outputs a model loaded from a bf16 / fp16 export may have (weights rounded)."""


class CheckFailed(Failure):
    """The exported file does not give the snapshot's model back: nothing is published."""

    cause = "export"


def _bound(source: Source, task: Any = None, setting: str = "PATH") -> tuple[dict[str, Any], BoundTask]:
    """The run's config (a dict, defaults filled in) and its task bound to one CPU process, from what
    `source` says of its run."""
    if source.config is None and task is None:
        raise ConfigError(f"{setting}={source.path}: a safetensors file without trainapp.json names no task; "
                          "pass task= (trainapp.load_model(path, task=MyTask())) or use an export directory")
    cfg = from_dict(source.config) if source.config is not None else from_dict({})
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None,
                      owns_group=False)
    if task is None:
        from trainapp.tasks.load import resolve  # a built-in task's module (torchvision...) only when named

        task = resolve(cfg)
    return cfg.to_dict(), bind(task, ctx, name=cfg.task.name, seed=cfg.seed, run_dir=cfg.run.dir)


def _model(bound: BoundTask, source: Source, setting: str) -> torch.nn.Module:
    """A fresh model of the task with `source`'s weights, every tensor checked to fit first."""
    model = bound.model()
    names, skipped = init.fit(model, source, [], strict=True, setting=setting)
    init.load_into(model, source, names)
    return model.eval()


def load_model(path: str | Path, task: Any = None) -> torch.nn.Module:
    """The task's model with the weights at `path` (an export directory or its `model.safetensors`, a run
    directory or a snapshot), in eval mode on the CPU; the task rebuilt from the run's config when not
    given (it must import here, as under `trainapp train`)."""
    source = open_source(path, setting="path")
    _, bound = _bound(source, task, "path")
    bound.datasets()  # a task may size its model by its data (a vocabulary), as in training
    return _model(bound, source, "path")


def _batch(bound: BoundTask, val: Any, size: int) -> Any:
    """The first `size` validation items as one batch (a stream's from its first shards on)."""
    if is_stream(val):
        items = list(itertools.islice((item for shard in val.shards() for item in val.open(shard, 0)), size))
        where = "the val stream's first items"
    else:
        items = [val[i] for i in range(min(size, len(val)))]
        where = "the val set"
    return bound.to_device(bound.collate(Items(items, lambda k: f"item {k} of {where}")))


def _flat(out: Any) -> list[torch.Tensor]:
    """The floating tensors of a forward's output (a tensor, tuples, lists and dicts of them, a Hugging
    Face ModelOutput), in order."""
    if isinstance(out, torch.Tensor):
        return [out.detach().float()] if out.is_floating_point() else []
    if isinstance(out, dict) or hasattr(out, "values") and callable(out.values):
        return [t for v in out.values() for t in _flat(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _flat(v)]
    return []


@torch.no_grad()
def outputs(bound: BoundTask, model: torch.nn.Module,
            batch: Any) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The tensors `model`'s forward returns while the task evaluates `batch`, and the evaluation's sums."""
    seen: list[Any] = []
    hook = model.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        sums = bound.evaluate(model, batch)
    finally:
        hook.remove()
    return _flat(seen), {k: float(v) for k, v in sums.items()}


def compare(ref: tuple[list, dict], got: tuple[list, dict], dtype: str) -> dict[str, Any]:
    """How `got` (a model loaded from the export) differs from `ref` (the snapshot's model)."""
    (a, a_sums), (b, b_sums) = ref, got
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return {"passed": False, "why": "the forward returned other tensors"}
    diff = max([(x - y).abs().max().item() for x, y in zip(a, b)] or [0.0])
    rel = max([((x - y).norm() / x.norm().clamp_min(1e-12)).item() for x, y in zip(a, b)] or [0.0])
    equal = all(torch.equal(x, y) for x, y in zip(a, b)) and a_sums == b_sums
    passed = equal if dtype == "fp32" else rel <= TOLERANCE[dtype]
    return {"passed": passed, "tensors": len(a), "equal": equal, "max_abs_diff": diff, "rel_l2": rel,
            **({"tolerance_rel_l2": TOLERANCE[dtype]} if dtype != "fp32" else {}),
            "metrics": {k: [a_sums[k], b_sums.get(k)] for k in a_sums}}


def export(path: str | Path, out: str | Path, step: int | None = None, ema: bool = False,
           dtype: str | None = None, check: bool = True, force: bool = False, task: Any = None) -> Path:
    """`trainapp export`: the export directory `out` of the snapshot at `path`; where it went."""
    t0 = time.perf_counter()
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ConfigError(f"--dtype {dtype}: use one of {', '.join(DTYPE_NAMES)}")
    source = open_source(path, ema=ema, step=step)
    config, bound = _bound(source, task)
    artifact = ArtifactDir(out, force)  # checked before anything is read
    try:
        record = _write(bound, source, artifact, config, dtype or "fp32", check)
    except BaseException:
        artifact.abort()
        raise
    where = artifact.publish({**record, "seconds": round(time.perf_counter() - t0, 3)})
    log.info("exported %s -> %s", source.path, where)
    return where


def _write(bound: BoundTask, source: Source, artifact: ArtifactDir, config: dict[str, Any], dtype: str,
           check: bool) -> dict[str, Any]:
    """The file (then the task's format) into `artifact`, checked; the record (`config`: the run's)."""
    _, val = bound.datasets()
    model = _model(bound, source, "PATH")
    source.release()  # a whole snapshot's mapped state.pt: its pages count in the RSS while it is mapped
    params = tensors_sha256(model.state_dict())  # as `trainapp inspect` prints it, before any cast
    batch = _batch(bound, val, config["train"]["batch_size"]) if check else None
    ref = outputs(bound, model, batch) if check else None
    if dtype != "fp32":
        model.to(DTYPE_NAMES[dtype])  # floating tensors only
    state = model.state_dict()
    entries, drop = plan(state, None)
    digest = write_state(artifact.writer(entries), state)
    hook = getattr(bound.task, "export", None)
    if callable(hook):
        hook(model, artifact.stage)
    del state, model
    gc.collect()
    result = (_check(bound, artifact, digest, batch, ref, dtype) if check
              else {"outputs": "not run (--no-check)"})
    return {"run_dir": _run_dir(source),
            "step": source.record.get("step"), "ema": bool(source.record.get("ema")), "source": source.record,
            "params_sha256": params, "tensors_sha256": digest, "tied": drop, "dtype": dtype, "check": result,
            "task": {"name": config["task"]["name"], "args": config["task"]["args"]}, "config": config,
            "task_export": "run" if callable(hook) else "the task has no export method",
            "written_by": "trainapp export", **versions()}


def _run_dir(source: Source) -> str | None:
    """The run directory of a snapshot source (`RUN/snapshots/step_*`, or Ray's `STORAGE/NAME/step_*`)."""
    if "snapshot" not in source.kind:
        return None
    parent = Path(source.path).parent
    return str(parent.parent if parent.name == "snapshots" else parent)


def _check(bound: BoundTask, artifact: ArtifactDir, digest: str, batch: Any,
           ref: tuple[list[torch.Tensor], dict[str, float]] | None, dtype: str) -> dict[str, Any]:
    """The file read back, then a fresh model loaded from it (strict: every name and shape, as safetensors'
    `load_model` checks them, streamed a batch of tensors at a time) against the snapshot's outputs."""
    assert ref is not None  # `_write` takes the snapshot's outputs when it checks
    if file_digest(artifact.file) != digest:
        raise CheckFailed(f"{artifact.file}: reads back other tensors than were written")
    try:
        fresh = _model(bound, open_source(artifact.file, setting="--out", digest=digest), "--out")
    except ConfigError as e:
        raise CheckFailed(f"the export does not load into a fresh model of the task: {e}") from None
    result = compare(ref, outputs(bound, fresh, batch), dtype)
    if not result["passed"]:
        raise CheckFailed(f"the export does not give the snapshot's model back: {result}; "
                          "nothing was written")
    return {"tensors": "read back equal to the written ones", "outputs": result}
