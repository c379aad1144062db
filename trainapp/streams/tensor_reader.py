"""Reading tensor shards (written by trainapp/streams/tensor_shards.py): `tensor_shards(folder)` is a stream
whose `open(shard, start)` seeks to `start` at once and slices a few hundred items of every column at a
time (no decoding). The items come back as they were written.

For a micro-batch of the task's default collate, the opened shard also serves the batch itself
(`ShardItems.take_batch`): the slices of its columns are what torch's default_collate would make of the
items, so no item is made one by one (trainapp/core/lane_reader.py uses it when the task has no collate of
its own). A structure default_collate cannot batch (a field None in some items, shapes that differ, numpy
dtypes torch lacks) is read item by item, and the collate says what it cannot batch.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from safetensors import safe_open

from trainapp.config import ConfigError
from trainapp.streams.tensor_shards import FORMAT, SCALARS, dtype_of, leaves, namedtuple_class

CHUNK = 256
"""Items read per slice of the columns: enough that a slice's cost is spread thin, few enough that a shard
of large items is not read whole."""
CONTAINERS = ("dict", "list", "tuple", "namedtuple")


class TensorShards:
    """A stream of tensor shards (`write_tensor_shards`): one shard per file, sorted by path."""

    def __init__(self, paths: Iterable[str | Path], transform: Callable[[Any], Any] | None = None):
        self._shards = sorted(str(p) for p in paths)  # one order on every rank, whatever the listing's
        if not self._shards:
            raise ValueError("no tensor shard files given")
        self.transform = transform
        self.random_items = transform is not None
        """Whether reading an item may draw random numbers: only a transform's can (trainapp then seeds
        the generators per item, trainapp/core/data.py's read_seeded)."""

    def shards(self) -> list[str]:
        return list(self._shards)

    def open(self, shard: str, start: int) -> Iterator[Any]:
        items = ShardItems(_Reader(shard), start)
        return map(self.transform, items) if self.transform else items


def tensor_shards(paths: str | Path | Iterable[str | Path],
                  transform: Callable[[Any], Any] | None = None) -> TensorShards:
    """The stream of a folder's `*.safetensors` tensor shards (or of the given files); an item is as it was
    written, or `transform` of it."""
    if isinstance(paths, (str, Path)) and Path(paths).is_dir():
        paths = sorted(Path(paths).glob("*.safetensors"))
    elif isinstance(paths, (str, Path)):
        paths = [paths]
    return TensorShards(paths, transform)


class ShardItems:
    """A shard's items from `start` on, one at a time (made a chunk at a time), or a micro-batch at a time
    (`take_batch`)."""

    def __init__(self, reader: _Reader, start: int):
        self.reader, self.pos = reader, start
        self.made: Iterator[Any] = iter(())  # items made ahead, up to the chunk's end
        self.batches = True

    def __iter__(self) -> ShardItems:
        return self

    def __next__(self) -> Any:
        item = next(self.made, self)
        if item is self:  # the chunk is used up: the next one
            if self.pos >= self.reader.count:
                raise StopIteration
            end = min(self.pos + CHUNK, self.reader.count)
            self.made = iter(self.reader.items(self.pos, end))
            item = next(self.made)
        self.pos += 1
        return item

    def take_batch(self, n: int) -> tuple[Any, Any] | None:
        """The next `n` items as torch's default_collate batches them, and the last of them as an item (for
        the stream's position check); None, reading nothing, when fewer are left or default_collate would
        not batch them as slices of the columns."""
        if not self.batches or self.pos + n > self.reader.count:
            return None
        try:
            batch = self.reader.collated(self.reader.node, self.pos, self.pos + n)
        except _NoBatch:
            self.batches = False
            return None
        last = self.reader.items(self.pos + n - 1, self.pos + n)[0]
        self.pos, self.made = self.pos + n, iter(())
        return batch, last


class _NoBatch(Exception):
    """A structure default_collate cannot batch as column slices."""


class _Reader:
    """One shard's file: its structure, and the rows of every column for a chunk of items at a time."""

    def __init__(self, path: str):
        self.path = path
        self.file = safe_open(path, framework="pt")
        meta = self.file.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ConfigError(f"{path} is not a tensor shard (its metadata has "
                              f"format={meta.get('format')!r}, not {FORMAT!r}); write it with "
                              "trainapp.streams.write_tensor_shards")
        self.count, self.node = int(meta["count"]), json.loads(meta["items"])
        self.raw: dict[str, list[Any]] = json.loads(meta.get("raw", "{}"))
        self.offsets = {leaf["c"]: self._load(leaf["c"] + ".offsets").tolist()
                        for _, leaf in leaves(self.node) if _flat(leaf)}
        """Where each item's elements begin in a column of flattened values (ragged tensors, text)."""
        self.rows = (0, 0)
        self.cols: dict[str, torch.Tensor] = {}

    def _load(self, name: str, a: int | None = None, b: int | None = None) -> torch.Tensor:
        """Rows a..b-1 of a column (all without a and b), in memory of their own: a slice of the file's
        mapping would carry the whole mapping wherever it went (a loader worker's batch)."""
        view = self.file.get_slice(name)
        t = view[a:b] if a is not None else view[:]
        if name in self.raw:  # stored as bytes: copied into memory of its own dtype (aligned for it)
            dtype, shape = self.raw[name]
            out = torch.empty((t.shape[0], *shape[1:]), dtype=dtype_of(dtype))
            out.view(torch.uint8).reshape(-1).copy_(t.reshape(-1))
            return out
        return t.clone()

    def _chunk(self, a: int, b: int) -> None:
        """Rows a..b-1 of every column at hand (a chunk from `a` on, when they are not)."""
        if self.rows[0] <= a and b <= self.rows[1]:
            return
        end = max(b, min(a + CHUNK, self.count))
        cols = {}
        for _, leaf in leaves(self.node):
            name = leaf["c"]
            if leaf.get("opt"):
                cols[name + ".present"] = self._load(name + ".present", a, end)
            if leaf["k"] in CONTAINERS:
                continue
            if _flat(leaf):
                off = self.offsets[name]
                cols[name] = self._load(name, off[a], off[end])
                if leaf["k"] not in ("str", "bytes"):
                    cols[name + ".shapes"] = self._load(name + ".shapes", a, end)
            else:
                cols[name] = self._load(name, a, end)
        self.rows, self.cols = (a, end), cols

    def _rows(self, name: str, a: int, b: int) -> torch.Tensor:
        return self.cols[name][a - self.rows[0]:b - self.rows[0]]

    def _parts(self, name: str, a: int, b: int) -> tuple[torch.Tensor, list[int]]:
        """A flattened column's values for items a..b-1, and where each item's begin in them (b - a + 1)."""
        off, base = self.offsets[name], self.offsets[name][self.rows[0]]
        return self.cols[name][off[a] - base:off[b] - base], [o - off[a] for o in off[a:b + 1]]

    def items(self, a: int, b: int) -> list[Any]:
        """Items a..b-1."""
        self._chunk(a, b)
        return self._build(self.node, a, b)

    def _build(self, node: dict[str, Any], a: int, b: int) -> list[Any]:
        k = node["k"]
        if k == "none":
            return [None] * (b - a)
        if k in CONTAINERS:
            columns = [self._build(child, a, b) for child in node["v"]]
            values = _containers(node, list(zip(*columns)) if columns else [()] * (b - a))
        elif k in ("str", "bytes"):
            values = self._text(node, a, b)
        elif k in SCALARS.values():
            values = self._rows(node["c"], a, b).tolist()
        else:
            values = self._arrays(node, a, b)
        if node.get("opt"):
            present = self._rows(node["c"] + ".present", a, b).tolist()
            values = [v if p else None for v, p in zip(values, present)]
        return values

    def _text(self, node: dict[str, Any], a: int, b: int) -> list[Any]:
        flat, at = self._parts(node["c"], a, b)
        raw = flat.numpy().tobytes()
        parts = [raw[at[i]:at[i + 1]] for i in range(b - a)]
        return [p.decode("utf-8", "surrogatepass") for p in parts] if node["k"] == "str" else parts

    def _arrays(self, node: dict[str, Any], a: int, b: int) -> list[Any]:
        if node["shape"] is not None:
            t = self._rows(node["c"], a, b)
            if node["k"] == "tensor":
                return list(t.unbind(0))
            arr = _array(t, node["dtype"], (b - a, *node["shape"]))
            return [arr[i] if node["k"] == "npscalar" else arr[i, ...] for i in range(b - a)]
        flat, at = self._parts(node["c"], a, b)
        shapes = self._rows(node["c"] + ".shapes", a, b).tolist()
        parts = [flat[at[i]:at[i + 1]] for i in range(b - a)]
        if node["k"] == "tensor":
            return [p.view(s) for p, s in zip(parts, shapes)]
        return [_array(p, node["dtype"], s) for p, s in zip(parts, shapes)]

    def collated(self, node: dict[str, Any], a: int, b: int) -> Any:
        """What torch's default_collate makes of items a..b-1, from the columns (_NoBatch when it would not
        batch them, or not as slices)."""
        self._chunk(a, b)
        return self._collated(node, a, b)

    def _collated(self, node: dict[str, Any], a: int, b: int, in_sequence: bool = False) -> Any:
        k = node["k"]
        if node.get("opt") or k in ("none", "complex") or node.get("shape", ()) is None:
            raise _NoBatch  # None, complex numbers and shapes that differ: default_collate refuses them
        if k in CONTAINERS:
            parts = [self._collated(child, a, b, k != "dict") for child in node["v"]]
            if k == "namedtuple":
                return namedtuple_class(node["cls"])(*parts)
            if k != "dict":
                return parts  # default_collate makes a list of a tuple's fields too
            return _mapping(node)(zip(node["keys"], parts))
        if k in ("str", "bytes"):  # as default_collate leaves them: a sequence's fields come transposed
            return tuple(self._text(node, a, b)) if in_sequence else self._text(node, a, b)
        t = self._rows(node["c"], a, b)
        if k in SCALARS.values() or k == "tensor":
            return t.clone()  # ints int64, floats float64, bools bool: as torch.tensor(list) makes them
        dtype = np.lib.format.descr_to_dtype(node["dtype"])
        if dtype.kind not in "biufc" or not dtype.isnative:
            raise _NoBatch  # strings, records, another byte order: not a tensor's dtype
        return torch.from_numpy(_array(t, node["dtype"], (b - a, *node["shape"])).copy())


def _flat(leaf: dict[str, Any]) -> bool:
    """Whether a leaf's values are one flattened column with offsets (text, or shapes that differ)."""
    return leaf["k"] in ("str", "bytes") or (leaf["k"] not in CONTAINERS and leaf.get("shape", ()) is None)


def _mapping(node: dict[str, Any]) -> type:
    return collections.OrderedDict if node.get("type") == "OrderedDict" else dict


def _containers(node: dict[str, Any], rows: list[tuple[Any, ...]]) -> list[Any]:
    k = node["k"]
    if k == "tuple":
        return rows
    if k == "list":
        return [list(r) for r in rows]
    if k == "namedtuple":
        return list(map(namedtuple_class(node["cls"])._make, rows))
    kind = _mapping(node)
    return [kind(zip(node["keys"], r)) for r in rows]


def _array(raw: torch.Tensor, descr: Any, shape: Iterable[int]) -> np.ndarray:
    """A numpy array of dtype `descr` and `shape` from its bytes."""
    dtype = np.lib.format.descr_to_dtype(descr)
    if dtype.itemsize == 0:  # 'S0', 'U0': no bytes to view
        return np.zeros(tuple(shape), dtype=dtype)
    return raw.numpy().reshape(-1).view(dtype).reshape(tuple(shape))
