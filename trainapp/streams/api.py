"""The stream contract: two methods, so that trainapp, not the stream, owns the position."""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Stream(Protocol):
    """Training data as shards read in order."""

    def shards(self) -> Sequence[Any]:
        """The shard descriptors (paths, URLs, indices: anything picklable), the same list in the same order
        on every rank and in every run that resumes this one."""

    def open(self, shard: Any, start: int) -> Iterable[Any]:
        """The items of `shard` from item `start` (0-based) on, in the same order every time: the item at
        `start` must be the one a read from 0 would give there. trainapp checks this when it resumes."""


def is_stream(data: Any) -> bool:
    """Whether `data` is a stream (has `shards()` and `open()`), rather than a map-style dataset."""
    return callable(getattr(data, "shards", None)) and callable(getattr(data, "open", None))
