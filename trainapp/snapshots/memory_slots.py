"""The memory tier's bytes: a rank's state in one of two slot files in host memory (a tmpfs such as
`/dev/shm`, which outlives the training process), written then committed with a sequence number and a
checksum, so that a copy a SIGKILL interrupted is never read.

A slot file is a 64-byte header, the pickled skeleton of the state (its tensors replaced by their index)
and the tensors' bytes, each 64-byte aligned. The header is written twice: first with sequence 0 (the slot
is being written: invalid), last with the new sequence number and the payload's checksum. Of an owner's
two slots the valid one with the higher sequence number is the newest; writing always goes to the other.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import xxhash

from trainapp.snapshots.loadable import same_kind

MAGIC = b"TAMEMv01"
HEADER = struct.Struct("<8sQQQQQ24x")  # magic, sequence, step, skeleton bytes, payload bytes, checksum
ALIGN = 64


@dataclass(frozen=True)
class Slot:
    """A valid slot's header: which write it was (`seq`), of which step, and its file."""

    path: Path
    seq: int
    step: int
    checksum: int
    size: int


class _Ref:
    """A tensor's place in the skeleton: its index among the payload's tensors."""

    def __init__(self, index: int):
        self.index = index


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`obj` with every tensor replaced by a `_Ref` (the tensors appended to `tensors`, on the CPU)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return _Ref(len(tensors) - 1)
    if isinstance(obj, dict):
        return same_kind(obj, {k: _split(v, tensors) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        if set(map(type, obj)) <= _PLAIN:  # numbers alone (a generator's state): as they are, at C speed
            return obj
        return type(obj)(_split(v, tensors) for v in obj)
    return obj


_PLAIN = frozenset({int, float, bool, str, bytes, type(None)})


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Ref):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return same_kind(obj, {k: _join(v, tensors) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_join(v, tensors) for v in obj)
    return obj


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def encode(state: Any) -> tuple[bytes, list[torch.Tensor], list[int]]:
    """(the skeleton's bytes, the tensors, each tensor's offset in the payload after the skeleton)."""
    tensors: list[torch.Tensor] = []
    skeleton = _split(state, tensors)
    specs = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]
    buf = io.BytesIO()
    pickle.dump((skeleton, specs), buf, protocol=pickle.HIGHEST_PROTOCOL)
    head = buf.getvalue()
    offsets, at = [], _pad(len(head))
    for t in tensors:
        offsets.append(at)
        at = _pad(at + t.numel() * t.element_size())
    return head, tensors, offsets + [at]


class SlotFile:
    """One slot file kept open and mapped between writes (the mapping is remade only when the size of the
    state changes): a copy is one pass over the tensors' bytes, no page faults of a fresh mapping."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.size = -1
        self.map: Any = None
        self.view: torch.Tensor | None = None

    @property
    def seq(self) -> int:
        """The committed sequence number of the slot (-1: none)."""
        head = header(self.path)
        return head.seq if head is not None else -1

    def _mapping(self, size: int) -> torch.Tensor:
        if size != self.size or self.view is None:
            self.view = None
            if self.map is not None:
                self.map.close()
            os.ftruncate(self.fd, size)
            self.map, self.size = _mapped(self.fd, size), size
            self.view = torch.frombuffer(self.map, dtype=torch.uint8)
        return self.view

    def write(self, state: Any, seq: int, step: int, midway: Callable[[], None] | None = None) -> Slot:
        """`state` (a tree of dicts, lists and tensors, any picklable leaves) into this slot, committed last:
        a crash at any point leaves either the old valid slot or an invalid one. `midway` is called with
        half the tensors written (a drill's kill)."""
        head, tensors, offsets = encode(state)
        size = offsets[-1]
        os.pwrite(self.fd, HEADER.pack(MAGIC, 0, step, len(head), size, 0), 0)  # invalid from here on
        body = self._mapping(HEADER.size + size)[HEADER.size:]
        body[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        for k, (t, at) in enumerate(zip(tensors, offsets)):
            if midway is not None and k == len(tensors) // 2:
                midway()
            n = t.numel() * t.element_size()
            if n:
                body[at:at + n].copy_(t.reshape(-1).view(torch.uint8) if t.is_contiguous()
                                      else t.contiguous().reshape(-1).view(torch.uint8))
        checksum = xxhash.xxh3_64_intdigest(memoryview(self.map)[HEADER.size:])
        os.pwrite(self.fd, HEADER.pack(MAGIC, seq, step, len(head), size, checksum), 0)  # the commit
        return Slot(self.path, seq, step, checksum, size)

    def close(self) -> None:
        self.view = None
        if self.map is not None:
            self.map.close()
            self.map = None
        os.close(self.fd)


def write(path: Path, state: Any, seq: int, step: int, midway: Callable[[], None] | None = None) -> Slot:
    """`state` into the slot file `path` once (`SlotFile.write`)."""
    slot = SlotFile(path)
    try:
        return slot.write(state, seq, step, midway)
    finally:
        slot.close()


def write_raw(path: Path, data: bytes) -> None:
    """A whole slot file's bytes (checked by `check`: another node's copy) into `path`, committed last."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        magic, seq, step, skeleton, payload, checksum = HEADER.unpack_from(data)
        os.pwrite(fd, HEADER.pack(magic, 0, step, skeleton, payload, 0), 0)
        os.ftruncate(fd, len(data))
        os.pwrite(fd, memoryview(data)[HEADER.size:], HEADER.size)
        os.pwrite(fd, data[:HEADER.size], 0)
    finally:
        os.close(fd)


def _mapped(fd: int, size: int) -> Any:
    import mmap

    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def header(path: Path) -> Slot | None:
    """The slot's header when it is committed (a sequence number, the file whole), else None: a missing,
    short, torn or foreign file. The checksum is checked when the slot is read (`read`)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(raw) < HEADER.size:
        return None
    magic, seq, step, _, payload, checksum = HEADER.unpack(raw)
    if magic != MAGIC or seq == 0 or size != HEADER.size + payload:
        return None
    return Slot(path, seq, step, checksum, payload)


def read_bytes(slot: Slot) -> bytes | None:
    """The slot file's bytes (header and payload) if its checksum holds, else None."""
    try:
        data = Path(slot.path).read_bytes()
    except OSError:
        return None
    return data if check(data, slot) else None


def check(data: bytes, slot: Slot | None = None) -> bool:
    """Whether `data` (a whole slot file) is committed and its payload matches its checksum (and, given
    `slot`, is that write)."""
    if len(data) < HEADER.size:
        return False
    magic, seq, step, _, payload, checksum = HEADER.unpack_from(data)
    if magic != MAGIC or seq == 0 or len(data) != HEADER.size + payload:
        return False
    if slot is not None and (seq, step, checksum) != (slot.seq, slot.step, slot.checksum):
        return False
    return xxhash.xxh3_64_intdigest(memoryview(data)[HEADER.size:]) == checksum


def decode(data: bytes) -> Any:
    """The state of a slot file's bytes (checked by `check` first)."""
    _, _, _, skeleton_len, _, _ = HEADER.unpack_from(data)
    body = memoryview(data)[HEADER.size:]
    skeleton, specs = pickle.loads(body[:skeleton_len])
    tensors, at = [], _pad(skeleton_len)
    for dtype, shape in specs:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        n = t.numel() * t.element_size()
        if n:
            raw = np.frombuffer(body, dtype=np.uint8, count=n, offset=at)
            t.reshape(-1).view(torch.uint8).numpy()[:] = raw
        tensors.append(t)
        at = _pad(at + n)
    return _join(skeleton, tensors)


def newest(paths: list[Path]) -> Slot | None:
    """The committed slot with the highest sequence number among an owner's slot files."""
    slots = [s for s in (header(p) for p in paths) if s is not None]
    return max(slots, key=lambda s: s.seq) if slots else None
