"""Streams made of common sources. Each is a few lines over the contract (trainapp/streams/api.py); a
source they do not fit needs only its own `shards()` and `open(shard, start)`."""

from __future__ import annotations

import itertools
import json
import tarfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence


class Shards:
    """A stream of `shards` (paths, or any descriptors) whose items `read(shard)` yields in order, such as
    a generator over a file's rows. `open(shard, start)` reads and drops the items before `start`: exact
    for any reader; a source that can seek (a row group, a byte offset) is faster with its own `open`."""

    def __init__(self, shards: Sequence[Any], read: Callable[[Any], Iterable[Any]]):
        self._shards, self.read = list(shards), read

    def shards(self) -> list[Any]:
        return list(self._shards)

    def open(self, shard: Any, start: int) -> Iterator[Any]:
        return itertools.islice(iter(self.read(shard)), start, None)


def _paths(paths: Iterable[str | Path]) -> list[str]:
    out = sorted(str(p) for p in paths)  # one order on every rank, whatever the listing's
    if not out:
        raise ValueError("no shard files given")
    return out


def jsonl(paths: Iterable[str | Path], transform: Callable[[Any], Any] | None = None) -> Shards:
    """One shard per JSON Lines file (sorted by path); an item is a line's value, or `transform` of it."""

    def read(path: str) -> Iterator[Any]:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    value = json.loads(line)
                    yield transform(value) if transform else value

    return Shards(_paths(paths), read)


def tar(paths: Iterable[str | Path], transform: Callable[[dict[str, Any]], Any] | None = None) -> Shards:
    """One shard per tar file in WebDataset's layout (sorted by path): consecutive members that share a
    key (the name up to its first dot) are one item, `{"__key__": key, extension: bytes, ...}`, or
    `transform` of that dict (decode the bytes there)."""

    def read(path: str) -> Iterator[Any]:
        with tarfile.open(path, mode="r|*") as archive:  # a stream: members in order, no index
            sample: dict[str, Any] = {}
            for member in archive:
                if not member.isfile():
                    continue
                name = member.name.rsplit("/", 1)[-1]
                key, _, ext = name.partition(".")
                if sample and key != sample["__key__"]:
                    yield transform(sample) if transform else sample
                    sample = {}
                sample["__key__"] = key
                reader = archive.extractfile(member)
                sample[ext] = reader.read() if reader is not None else b""
            if sample:
                yield transform(sample) if transform else sample

    return Shards(_paths(paths), read)


class HuggingFace:
    """A Hugging Face `datasets.IterableDataset` (`load_dataset(..., streaming=True)`) as a stream: one
    shard per data source of the dataset (`n_shards`: its files), opened with `shard()` and `skip()`; an
    item is a row, or `transform` of it. Transforms (`map`, `filter`) applied before it is wrapped stay
    applied; do not shuffle it (trainapp orders the shards, seeded per epoch)."""

    def __init__(self, dataset: Any, transform: Callable[[Any], Any] | None = None):
        if not (hasattr(dataset, "n_shards") and callable(getattr(dataset, "shard", None))):
            raise TypeError(f"{type(dataset).__name__} is not a datasets.IterableDataset (load_dataset(..., "
                            "streaming=True) makes one)")
        self.dataset, self.transform = dataset, transform

    def shards(self) -> list[int]:
        return list(range(self.dataset.n_shards))

    def open(self, shard: int, start: int) -> Iterator[Any]:
        part = self.dataset.shard(num_shards=self.dataset.n_shards, index=shard, contiguous=True)
        rows = _rows((part.skip(start) if start else part).iter(batch_size=64))
        return map(self.transform, rows) if self.transform else rows


def _rows(batches: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The rows of `IterableDataset.iter`'s batches (columns of values). Not `iter(dataset)`: inside a
    DataLoader worker that splits the dataset's shards over the workers again, and the shard that
    trainapp gave this worker would be read by one of them only."""
    for batch in batches:
        columns = list(batch)
        for i in range(len(batch[columns[0]]) if columns else 0):
            yield {c: batch[c][i] for c in columns}
