"""The memory tier's bytes: a rank's state in one of two slot files in host memory (a tmpfs such as
`/dev/shm`, which outlives the training process), written then committed with a sequence number and a
checksum, so that a copy a SIGKILL interrupted is never read.

A slot file is a 64-byte header, the tensors' bytes (each at a 64-byte aligned offset) and the pickled
state with every tensor replaced by its index, after the list of the tensors' offsets, dtypes and shapes.
The header is written twice: first with sequence 0 (the slot is being written: invalid), last with the
new sequence number and the payload's checksum. Of an owner's two slots the valid one with the higher
sequence number is the newest; writing always goes to the other.

A copy runs at every step, so it is made cheap: the tensors come first, at offsets that depend only on
their dtypes and shapes, so a slot keeps its typed views of them from one copy to the next and a copy is
a `copy_` of each into its view; pickle's own walk (in C) finds the tensors (`reducer_override`),
not a walk of the state in Python.
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

MAGIC = b"TAMEMv03"  # v03: a tensor's kind (a parameter, requires grad) in the pickle
HEADER = struct.Struct("<8sQQQQQ24x")  # magic, sequence, step, tensor bytes, pickle bytes, checksum
ALIGN = 64
SLACK = 64 * 1024
"""Room a slot's file keeps after the pickled state, so that a state whose numbers grow by a few bytes
(a step count, a longer name) does not remake the mapping and its views."""


@dataclass(frozen=True)
class Slot:
    """A valid slot's header: which write it was (`seq`), of which step, and its file."""

    path: Path
    seq: int
    step: int
    checksum: int
    size: int
    """The payload's bytes (the tensors' and the pickle's), after the header."""


def _tensor(index: int, kind: str = "") -> Any:
    """What the pickled state names for its `index`-th tensor, of `kind` (`_kind`); `decode` puts the
    tensor in its place."""
    raise pickle.UnpicklingError("a memory slot's state is read by memory_slots.decode")


class _Pickler(pickle.Pickler):
    """Pickles a state with each tensor replaced by its index in `tensors` (a tensor that is in the state
    twice is stored once, as pickle keeps any object)."""

    def __init__(self, buf: io.BytesIO):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return _tensor, (len(self.tensors) - 1, _kind(obj))
        return NotImplemented


def _kind(t: torch.Tensor) -> str:
    """What a tensor is besides its values, as torch.save keeps it: a parameter (that does or does not
    require grad), a tensor that requires grad, or a plain one ("")."""
    if isinstance(t, torch.nn.Parameter):
        return "param" if t.requires_grad else "param-nograd"
    return "grad" if t.requires_grad else ""


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _layout(tensors: list[torch.Tensor]) -> tuple[list[tuple[int, str, tuple[int, ...]]], int]:
    """Each tensor's (offset, dtype, shape) in the tensors' bytes, and those bytes' size."""
    specs, at = [], 0
    for t in tensors:
        specs.append((at, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        at = _pad(at + t.numel() * t.element_size())
    return specs, at


class SlotFile:
    """One slot file kept open and mapped between writes, with typed views of where each tensor goes: while
    the tensors' dtypes and shapes stay the same (as a training state's do), a copy makes no view and no
    mapping, it copies the tensors' bytes and pickles the rest."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.size = -1
        self.map: Any = None
        self.key: list[tuple[torch.dtype, torch.Size]] | None = None
        """The dtypes and shapes `dsts` and `specs` were made for."""
        self.dsts: list[torch.Tensor] = []
        self.specs = b""
        """The pickled list of the tensors' (offset, dtype, shape)."""
        self.region = 0
        """The tensors' bytes."""

    @property
    def seq(self) -> int:
        """The committed sequence number of the slot (-1: none)."""
        head = header(self.path)
        return head.seq if head is not None else -1

    def _views(self, tensors: list[torch.Tensor], pickled: int) -> list[torch.Tensor]:
        """Where each of `tensors` goes (the mapping made again when the tensors' dtypes or shapes changed,
        or when it has no room for `pickled` bytes of pickle after them); kept for the next write."""
        key = [(t.dtype, t.shape) for t in tensors]
        if key == self.key and HEADER.size + self.region + len(self.specs) + pickled <= self.size:
            return self.dsts
        self._unmap()
        specs, self.region = _layout(tensors)
        self.specs = pickle.dumps(specs, protocol=pickle.HIGHEST_PROTOCOL)
        size = HEADER.size + self.region + len(self.specs) + pickled + SLACK
        os.ftruncate(self.fd, size)
        self.map, self.size = _mapped(self.fd, size), size
        body = torch.frombuffer(self.map, dtype=torch.uint8)[HEADER.size:]
        self.dsts = [body[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                     for (at, _, _), t in zip(specs, tensors)]
        self.key = key
        return self.dsts

    def _unmap(self) -> None:
        self.dsts, self.key = [], None  # views into the mapping: gone before it is closed
        if self.map is not None:
            self.map.close()
            self.map = None

    def write(self, state: Any, seq: int, step: int, midway: Callable[[], None] | None = None) -> Slot:
        """`state` (a tree of dicts, lists and tensors, any picklable leaves) into this slot, committed last:
        a crash at any point leaves either the old valid slot or an invalid one. `midway` is called with
        half the tensors written (a drill's kill)."""
        os.pwrite(self.fd, HEADER.pack(MAGIC, 0, step, 0, 0, 0), 0)  # invalid from here on
        buf = io.BytesIO()
        pickler = _Pickler(buf)
        pickler.dump(state)
        tensors = pickler.tensors
        dsts = self._views(tensors, buf.tell())
        rest = self.specs + buf.getvalue()
        half = len(tensors) // 2
        with torch.no_grad():  # a parameter in a task's state copies as its data
            _copy(dsts[:half], tensors[:half])
            if midway is not None:
                midway()
            _copy(dsts[half:], tensors[half:])
        payload = self.region + len(rest)
        with memoryview(self.map) as mv:
            mv[HEADER.size + self.region:HEADER.size + payload] = rest
            checksum = xxhash.xxh3_64_intdigest(mv[HEADER.size:HEADER.size + payload])
        os.pwrite(self.fd, HEADER.pack(MAGIC, seq, step, self.region, len(rest), checksum), 0)  # the commit
        return Slot(self.path, seq, step, checksum, payload)

    def close(self) -> None:
        self._unmap()
        os.close(self.fd)


def _copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Each source into its view (a GPU's tensor is copied to the host). Not `torch._foreach_copy_`: with
    the views kept it saves little (docs/benchmarks.md#the-memory-tier), and it is private: trainapp reads
    torch's private names only in core/, above this layer."""
    for d, t in zip(dsts, srcs):
        d.copy_(t)


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
        magic, seq, step, region, pickled, checksum = HEADER.unpack_from(data)
        os.pwrite(fd, HEADER.pack(magic, 0, step, region, pickled, 0), 0)
        os.ftruncate(fd, len(data))
        os.pwrite(fd, memoryview(data)[HEADER.size:], HEADER.size)
        os.pwrite(fd, data[:HEADER.size], 0)
    finally:
        os.close(fd)


def _mapped(fd: int, size: int) -> Any:
    import mmap

    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def header(path: Path) -> Slot | None:
    """The slot's header when it is committed (a sequence number, the file long enough), else None: a
    missing, short, torn or foreign file. The checksum is checked when the slot is read (`read_bytes`)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(raw) < HEADER.size:
        return None
    magic, seq, step, region, pickled, checksum = HEADER.unpack(raw)
    if magic != MAGIC or seq == 0 or size < HEADER.size + region + pickled:
        return None
    return Slot(path, seq, step, checksum, region + pickled)


def read_bytes(slot: Slot) -> bytes | None:
    """The slot's bytes (header and payload, without the file's slack) if its checksum holds, else None."""
    data = read_raw(slot.path)
    return data if check(data, slot) else None


def read_raw(path: Path | str) -> bytes:
    """A slot file's header and the payload it says it has (b"" when unreadable), unchecked."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
            if len(raw) < HEADER.size:
                return raw
            _, _, _, region, pickled, _ = HEADER.unpack(raw)
            return raw + f.read(region + pickled)
    except OSError:
        return b""


def check(data: bytes, slot: Slot | None = None) -> bool:
    """Whether `data` (a slot's bytes, as `read_bytes` gives them) is committed and its payload matches its
    checksum (and, given `slot`, is that write)."""
    if len(data) < HEADER.size:
        return False
    magic, seq, step, region, pickled, checksum = HEADER.unpack_from(data)
    if magic != MAGIC or seq == 0 or len(data) != HEADER.size + region + pickled:
        return False
    if slot is not None and (seq, step, checksum) != (slot.seq, slot.step, slot.checksum):
        return False
    return xxhash.xxh3_64_intdigest(memoryview(data)[HEADER.size:]) == checksum


class _Unpickler(pickle.Unpickler):
    """Unpickles a slot's state, each tensor index given its tensor."""

    def __init__(self, buf: io.BytesIO, tensors: list[torch.Tensor]):
        super().__init__(buf)
        self.tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (__name__, _tensor.__name__):
            return self._tensor
        return super().find_class(module, name)

    def _tensor(self, index: int, kind: str = "") -> torch.Tensor:
        """The `index`-th tensor made what `_kind` named, so that a state read from memory loads as one
        read from storage (a task that assigns a parameter from its state keeps a parameter)."""
        t = self.tensors[index]
        if kind.startswith("param"):
            return torch.nn.Parameter(t, requires_grad=kind == "param")
        return t.requires_grad_() if kind == "grad" else t


def decode(data: bytes) -> Any:
    """The state of a slot's bytes (checked by `check` first): its tensors copied out of `data`."""
    _, _, _, region, _, _ = HEADER.unpack_from(data)
    body = memoryview(data)[HEADER.size:]
    buf = io.BytesIO(body[region:])
    specs = pickle.load(buf)
    tensors = []
    for at, dtype, shape in specs:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        n = t.numel() * t.element_size()
        if n:
            raw = np.frombuffer(body, dtype=np.uint8, count=n, offset=at)
            t.reshape(-1).view(torch.uint8).numpy()[:] = raw
        tensors.append(t)
    return _Unpickler(buf, tensors).load()


def newest(paths: list[Path]) -> Slot | None:
    """The committed slot with the highest sequence number among an owner's slot files."""
    slots = [s for s in (header(p) for p in paths) if s is not None]
    return max(slots, key=lambda s: s.seq) if slots else None
