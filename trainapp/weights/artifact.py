"""An export directory: `model.safetensors` (the weights under the user's module's names, tied weights
stored once) and `trainapp.json` (what it is and where it came from), published as a whole.

Both `trainapp export` (trainapp/tools/export.py) and the end of a run (trainapp/core/final.py) write it
through `ArtifactDir`: everything goes into a staging directory beside the destination, the record
last, then one rename puts the directory in place. An export killed half-way leaves a `.tmp-*`
directory, never a `model.safetensors` under the destination's name that looks complete.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from trainapp.errors import ConfigError
from trainapp.snapshots.files import fsync_dir, replace_dir, write_bytes
from trainapp.snapshots.store import staging
from trainapp.weights.safetensors_file import Entry, Writer
from trainapp.weights.sources import FILE, RECORD

FORMAT = 1
DTYPE_NAMES = MappingProxyType({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16})
"""`--dtype` / the export dtype's names -> torch's."""


def versions() -> dict[str, str]:
    """The versions an export record names."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mine = version("trainapp")
    except PackageNotFoundError:  # run from a checkout that was not installed
        mine = "unknown"
    return {"trainapp": mine, "torch": torch.__version__}


def _storage_key(t: torch.Tensor) -> tuple | None:
    """What two state-dict entries of one parameter share (a DTensor's local shard for FSDP); None for an
    empty tensor, whose storage pointer says nothing."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if local.numel() == 0:
        return None
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride(),
            local.dtype)


def tied(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """{name dropped: name kept} for the entries of `state` that are one tensor under several names (tied
    weights: an embedding and its output layer); the kept name is the first in sorted order, as
    safetensors' `save_model` keeps it, and its `load_model` fills the others."""
    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        key = _storage_key(t)
        if key is not None:
            groups.setdefault(key, []).append(name)
    return {n: min(names) for names in groups.values() if len(names) > 1 for n in names if n != min(names)}


def export_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype an entry is stored in: `dtype` for floating tensors, their own for the rest."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def plan(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> tuple[list[Entry], dict[str, str]]:
    """The entries of a model's state (DTensors by their global shape) to store, each tied group once,
    and the tied names left out."""
    drop = tied(state)
    entries = [Entry(n, export_dtype(t, dtype), tuple(t.shape)) for n, t in state.items() if n not in drop]
    return entries, drop


def write_state(writer: Writer, state: dict[str, torch.Tensor]) -> str:
    """Every pending entry of `writer` from `state` (cast to the entry's dtype), one tensor at a time; the
    file's digest."""
    for e in writer.pending:
        writer.add(e.name, state[e.name].detach().to("cpu", e.dtype))
    return writer.close()


class ArtifactDir:
    """The staging directory of export `out`; `publish(record)` puts it in place. `force`: an `out` that
    exists and is not empty is replaced (else ConfigError naming it)."""

    def __init__(self, out: Path | str, force: bool = False, setting: str = "--out") -> None:
        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"{setting} {self.out}: exists and is not a directory; choose another path")
        if self.out.is_dir() and any(self.out.iterdir()) and not force:
            raise ConfigError(f"{setting} {self.out}: exists and is not empty; choose another path or pass "
                              "--force to replace it")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        for left in self.out.parent.glob(f".tmp-{self.out.name}-*"):  # an export killed half-way left it
            shutil.rmtree(left, ignore_errors=True)
        self.stage = staging(self.out)
        self.stage.mkdir()
        self.file = self.stage / FILE

    def writer(self, entries: list[Entry], metadata: dict[str, str] | None = None) -> Writer:
        return Writer(self.file, entries, metadata)

    def publish(self, record: dict[str, Any]) -> Path:
        """The record written last, the directory renamed into place (an old one moved aside first)."""
        record = {"format": FORMAT, "file": FILE, "bytes": self.file.stat().st_size,
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **record}
        write_bytes(self.stage / RECORD, lambda f: f.write(json.dumps(record, indent=2, sort_keys=True,
                                                                       default=str).encode()))
        fsync_dir(self.stage)
        return replace_dir(self.stage, self.out)

    def abort(self) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)
