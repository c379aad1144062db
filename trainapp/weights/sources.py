"""Where a model's weights can be read from, each as a `Source`: names, dtypes and shapes first (what a
model is checked against before anything is read), then the tensors a few at a time.

- an export directory (`model.safetensors` + `trainapp.json`; the file's digest checked against the record);
- a `.safetensors` file from anywhere (the user's own, a hub download);
- a run's snapshot: a run directory (its newest valid snapshot, as a resume would choose it), a
  snapshots directory or one snapshot; `step` picks another. A whole snapshot's `state.pt` is mapped,
  not read (only the model's pages are touched, never the optimizer's); a sharded one's shards are read
  through torch.distributed.checkpoint in one process, a batch of tensors at a time, at any world size.

Names are the user's module's: the EMA copy's `module.` prefix (torch's AveragedModel) and its counter
go, and so do the components wrappers add (`_orig_mod.` of torch.compile, `_checkpoint_wrapped_module.`,
`_fsdp_wrapped_module.`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import torch

from trainapp.errors import ConfigError
from trainapp.snapshots import store
from trainapp.weights.safetensors_file import Entry, file_digest, read_header

FILE, RECORD = "model.safetensors", "trainapp.json"
"""The two files of an export directory."""
WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
BATCH_BYTES = 16 << 20
"""How much of a source is read at a time (a batch of whole tensors, at least one). The peak memory of
loading it is the model plus one batch: bench/export.py measured 16 MiB no slower than 256 MiB, and the
peak 1.23x the model's bytes instead of 2.04x (a 288 MiB model)."""


def plain_name(raw: str, ema: bool) -> str:
    """The user's module's name for a snapshot's key `raw` (of the EMA copy when `ema`)."""
    name = raw.removeprefix("module.") if ema else raw
    for w in WRAPPERS:
        name = name.replace(w, "")
    return name


@dataclass
class Source:
    """Weights to read: `entries` by the user's names; `read(names)` gives those tensors (CPU, as stored)."""

    path: str
    kind: str
    """`export`, `safetensors`, `snapshot` or `sharded snapshot`."""
    entries: dict[str, Entry]
    reader: Callable[[list[str]], dict[str, torch.Tensor]] = field(repr=False)
    record: dict[str, Any] = field(default_factory=dict)
    """What a run started from it, or an export of it, says it came from (path, kind, step, digests)."""
    config: dict[str, Any] | None = None
    """The config of the run that wrote it (a snapshot's, or an export's record), if known."""

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return self.reader(names)

    def release(self) -> None:
        """Done reading: what the reader holds (a mapped snapshot) goes."""
        def gone(names: list[str]) -> dict[str, torch.Tensor]:
            raise RuntimeError(f"{self.path}: read after release()")

        self.reader = gone

    def batches(self, names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
        """`names` read in batches of about BATCH_BYTES."""
        batch, size = [], 0
        for name in names:
            batch.append(name)
            size += self.entries[name].nbytes
            if size >= BATCH_BYTES:
                yield self.read(batch)
                batch, size = [], 0
        if batch:
            yield self.read(batch)


def open_source(path: str | Path, ema: bool = False, step: int | None = None, setting: str = "PATH",
                digest: str | None = None) -> Source:
    """The weights `path` names (`setting`: how the user gave it, for the one-line errors; `digest`: a
    safetensors file's tensors' digest, when known)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{setting}={path}: no such file or directory; give an export directory, "
                          "a .safetensors file, a run directory or a snapshot")
    if p.is_file() and p.suffix == ".safetensors" or (p / FILE).is_file():
        if ema or step is not None:
            raise ConfigError(f"{setting}={path}: an exported model has no {'EMA copy' if ema else 'steps'}; "
                              f"{'--ema' if ema else '--step'} applies to a run directory or a snapshot")
        return _safetensors(p, digest)
    return _snapshot(_find_snapshot(p, step, setting), ema, setting)


def _safetensors(p: Path, digest: str | None = None) -> Source:
    """`digest`: the file's tensors' digest when the caller knows it (it is read once less)."""
    from safetensors import safe_open

    file = p if p.is_file() else p / FILE
    entries, _ = read_header(file)
    record, config, kind = {}, None, "safetensors"
    if (file.parent / RECORD).is_file() and file.name == FILE:
        kind = "export"
        record = _read_record(file.parent / RECORD)
        want = record.get("tensors_sha256")
        if want and file_digest(file) != want:
            raise ConfigError(f"{file}: its tensors do not match {RECORD} (tensors_sha256 differs: a corrupt "
                              "or replaced file); export it again")
        config = record.get("config")

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        with safe_open(str(file), framework="pt") as f:
            return {n: f.get_tensor(n) for n in names}

    digest = digest or record.get("tensors_sha256") or file_digest(file)
    return Source(str(file), kind, entries, read, {"path": str(file), "kind": kind, "tensors_sha256": digest,
                                                   **({"step": record["step"]} if "step" in record else {})},
                  config)


def _read_record(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable ({e.__class__.__name__}: {e}); "
                          "export the model again") from None
    if not isinstance(out, dict):
        raise ConfigError(f"{path}: not a trainapp export record")
    return out


def _find_snapshot(p: Path, step: int | None, setting: str) -> Path:
    if step is None:
        return store.resolve(p)
    roots = [p / "snapshots", p]
    snaps = [s for root in roots for s in store.list_snapshots(root)]
    for snap in snaps:
        if store.step_of(snap.name) == step:
            return snap
    # list_snapshots lists step_* directories only: each has a step.
    have = sorted(cast(set[int], {store.step_of(s.name) for s in snaps}))
    raise ConfigError(f"--step {step}: {p} has no snapshot of that step (it has {have or 'none'}); "
                      "pick one of those or leave --step out for the newest")


def _snapshot(snap: Path, ema: bool, setting: str) -> Source:
    meta = store.verify(snap)  # checksums: a corrupt snapshot is refused, as a resume refuses it
    state = torch.load(snap / store.STATE, map_location="cpu", weights_only=True, mmap=True)
    part = "ema" if ema else "model"
    if state.get(part) is None:
        raise ConfigError(f"--ema: the run of {snap} has no EMA copy (train.ema_decay was 0); "
                          "export without --ema")
    record = {"path": str(snap), "kind": "snapshot", "step": meta.get("global_step"),
              "xxh3_128": meta.get("xxh3_128"),
              **({"params_sha256": meta["params_sha256"]} if "params_sha256" in meta else {}), "ema": ema}
    config = state.get("config")
    if isinstance(state[part], str) and state[part] == store.SHARDED:
        entries, reader = _sharded(snap, part, ema)
        return Source(str(snap), "sharded snapshot", entries, reader, {**record, "kind": "sharded snapshot"},
                      config)
    raw = {plain_name(k, ema): k for k, v in state[part].items() if torch.is_tensor(v) and k != "n_averaged"}
    entries = {n: Entry(n, state[part][k].dtype, tuple(state[part][k].shape)) for n, k in raw.items()}
    del state  # mapped afresh for each batch: a page read stays in the RSS only while its batch is alive

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        tensors = torch.load(snap / store.STATE, map_location="cpu", weights_only=True, mmap=True)[part]
        return {n: tensors[raw[n]] for n in names}

    return Source(str(snap), "snapshot", entries, read, record, config)


def _sharded(snap: Path, part: str, ema: bool) -> tuple[dict[str, Entry], Callable]:
    """Entries and reader of the `part` of a sharded snapshot's shards (DCP keys `PART.model.NAME`)."""
    saved = store.sharded_part(snap, part)
    tensors = {k: kind for k, kind in saved.items() if kind is not None and k != "n_averaged"}
    raw = {plain_name(k, ema): k for k in tensors}
    entries = {n: Entry(n, tensors[k][1], tuple(tensors[k][0])) for n, k in raw.items()}

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        out = store.read_sharded(snap, part, {raw[n]: tensors[raw[n]] for n in names})
        return {n: out[raw[n]] for n in names}

    return entries, read
