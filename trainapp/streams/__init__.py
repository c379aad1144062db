"""Streams: training data read in order, shard by shard, with no length and no random access (WebDataset
tar shards, JSONL files, a Hugging Face streaming dataset, a generator over Parquet files).

A task's `datasets(ctx)` may return a stream as its train set (and as its validation set): any object
with `shards()` and `open(shard, start)` (`Stream`). trainapp owns the position in it
(trainapp/core/stream.py): which shards each rank reads, each shard's cursor and the epoch, in every
snapshot. The adapters here make a stream of common sources (docs/your-own-model.md, "Streaming data").
"""

from trainapp.streams.adapters import HuggingFace, Shards, jsonl, tar
from trainapp.streams.api import Stream, is_stream

__all__ = ["HuggingFace", "Shards", "Stream", "is_stream", "jsonl", "tar"]
