"""The safetensors file trainapp exports, written one tensor at a time.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian header size, a JSON
header naming each tensor's dtype, shape and byte range, then the tensors' bytes back to back. The
header needs only names, dtypes and shapes, so the file can be written as the tensors come: from a
model in memory, from a snapshot's shards read a few at a time, or from an FSDP model gathered one
parameter at a time, never the whole model at once. safetensors' own `save_file` takes every tensor
at once; its reader (`safe_open`, `load_file`, `load_model`) reads what this writes, and every
export is read back with it.

Tensors go in sorted name order, so the digest taken in passing is trainapp's `tensors_sha256` of the
file's tensors (the one `trainapp inspect` prints for a snapshot's model: the same number when the
model has no tied weights and the dtype is unchanged). The file is written under a temporary name,
fsynced, then renamed: a `model.safetensors` that exists is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from trainapp.errors import ConfigError

DTYPES = MappingProxyType({
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"})
"""torch dtype -> the format's name for it."""
NAMES = MappingProxyType({v: k for k, v in DTYPES.items()})
MAX_HEADER = 100 << 20
"""The largest header safetensors' readers accept."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a file, as its header describes it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    """The file's header for `entries` in this order, padded so the data starts 8-byte aligned."""
    table: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    at = 0
    for e in entries:
        if e.dtype not in DTYPES:
            raise ConfigError(f"{e.name}: dtype {e.dtype} has no safetensors name; export it as one of "
                              f"{', '.join(sorted(set(DTYPES.values())))}")
        table[e.name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape),
                         "data_offsets": [at, at + e.nbytes]}
        at += e.nbytes
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of `t` on the CPU, contiguous (little-endian, as every machine trainapp runs on)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    # numpy's stubs declare ndarray's buffer protocol for Python 3.12 and later only.
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


class Writer:
    """Writes `path`: the header of `entries` (in sorted name order) first, then each tensor as `add`
    hands it over, in that order; `close()` makes the file whole (fsync, rename). A writer left
    unclosed (an error) removes its temporary file with `abort()`."""

    def __init__(self, path: Path, entries: list[Entry], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.entries = sorted(entries, key=lambda e: e.name)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.digest = hashlib.sha256()
        self._next = 0
        self._file = open(self.tmp, "wb")
        self._file.write(header(self.entries, metadata or {}))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        want = self.entries[self._next]
        if name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
            raise ValueError(f"safetensors writer: got {name} {tensor.dtype} {tuple(tensor.shape)}, expected "
                             f"{want.name} {want.dtype} {want.shape}")
        data = tensor_bytes(tensor)
        self.digest.update(data)
        self._file.write(data)
        self._next += 1

    @property
    def pending(self) -> list[Entry]:
        """The entries not written yet, in the order `add` wants them."""
        return self.entries[self._next:]

    def close(self) -> str:
        """The file in place, complete; the sha256 of its tensors (trainapp's `tensors_sha256`)."""
        if self._next != len(self.entries):
            raise ValueError(f"safetensors writer: {len(self.entries) - self._next} tensor(s) not written "
                             f"({self.entries[self._next].name} first)")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.rename(self.tmp, self.path)
        return self.digest.hexdigest()

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.tmp.unlink(missing_ok=True)


def read_header(path: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    """(name -> Entry, metadata) of the safetensors file `path`; ConfigError naming it when it is not
    one (a truncated or corrupt file, another format)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise ValueError(f"header size {n} in a file of {size} bytes")
            table = json.loads(f.read(n))
        meta = table.pop("__metadata__", None) or {}
        entries = {k: Entry(k, NAMES[v["dtype"]], tuple(v["shape"])) for k, v in table.items()}
        end = max((v["data_offsets"][1] for v in table.values()), default=0)
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise ConfigError(f"{path}: not a safetensors file or corrupt "
                          f"({e.__class__.__name__}: {e})") from None
    if 8 + n + end != size:
        raise ConfigError(f"{path}: {size} bytes, its header describes {8 + n + end} (truncated or corrupt)")
    return entries, meta


def file_digest(path: Path) -> str:
    """trainapp's `tensors_sha256` of the tensors in `path` (sorted name order), read a tensor at a time."""
    from safetensors import safe_open

    entries, _ = read_header(path)
    h = hashlib.sha256()
    with safe_open(str(path), framework="pt") as f:
        for name in sorted(entries):
            h.update(tensor_bytes(f.get_tensor(name)))
    return h.hexdigest()
