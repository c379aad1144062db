"""Streams: training data read in order, shard by shard, with no length and no random access (WebDataset
tar shards, JSONL files, a Hugging Face streaming dataset, a generator over Parquet files).

A task's `datasets(ctx)` may return a stream as its train set (and as its validation set): any object
with `shards()` and `open(shard, start)` (`Stream`). trainapp owns the position in it
(trainapp/core/stream.py): which shards each rank reads, each shard's cursor and the epoch, in every
snapshot. The adapters here make a stream of common sources (docs/your-own-model.md, "Streaming data");
tensor shards (`write_tensor_shards`, `tensor_shards`) are the fast path: items stored as tensors, read
without decoding.
"""

from trainapp.streams.adapters import HuggingFace, Shards, jsonl, tar
from trainapp.streams.api import Stream, is_stream
from trainapp.streams.tensor_reader import TensorShards, tensor_shards
from trainapp.streams.tensor_shards import write_tensor_shards

__all__ = ["HuggingFace", "Shards", "Stream", "TensorShards", "is_stream", "jsonl", "tar", "tensor_shards",
           "write_tensor_shards"]
