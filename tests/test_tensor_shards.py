"""Tensor shards (trainapp/streams/tensor_shards.py), the fast path for streams: every kind of item reads
back as it was written (types, dtypes, shapes, values; a field None in some items, shapes that differ
between items), from any start; the file is plain safetensors; an item that cannot be stored is one line
naming it."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from test_items import ITEMS, Pair
from torch.utils.data import default_collate

from trainapp import streams
from trainapp.config import ConfigError
from trainapp.core.items import item_digest
from trainapp.streams.tensor_reader import CHUNK

ALL_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32,
              torch.int64, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
              torch.complex32, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


def rich(i: int) -> dict:
    """Item i: every dtype as a 0-dim tensor, shapes that differ between items, fields None in some items,
    numpy arrays of strings, records and the other byte order, text, and containers of every kind."""
    g = torch.Generator().manual_seed(i)
    return {
        "x": torch.randn(3, 4, generator=g).t(),  # not contiguous
        "scalars": [torch.tensor(i % 3).to(d) for d in ALL_DTYPES],
        "tokens": torch.arange(i % 7),  # a length per item, 0 included
        "grid": np.arange((i % 3) * 2, dtype="<i2").reshape(-1, 2),
        "mask": None if i % 4 == 0 else torch.tensor([True, i % 2 == 0]),
        "meta": None if i % 5 == 0 else collections.OrderedDict(
            [("name", f"ítem-{i}" * (i % 3)), ("raw", bytes(range(i % 4))), (3, np.float16(i / 4))]),
        "pair": Pair(np.array(["ab", "c"][: 1 + i % 2]),
                     np.array([(i, 0.5)], dtype=[("a", ">i4"), ("b", "<f8")])),
        "nums": (i, i / 3, i % 2 == 0, complex(i, -1), None),
        "big": np.array(i, dtype=">f8"),
    }


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_every_kind_of_item_reads_back_as_written_from_any_start(tmp_path):
    items = [rich(i) for i in range(700)]
    paths = streams.write_tensor_shards(items, tmp_path, items_per_shard=CHUNK + 44)
    assert [p.name for p in paths] == ["shard-00000.safetensors", "shard-00001.safetensors",
                                       "shard-00002.safetensors"]
    stream = streams.tensor_shards(tmp_path)
    assert stream.shards() == [str(p) for p in paths] and streams.is_stream(stream)
    back = [item for shard in stream.shards() for item in stream.open(shard, 0)]
    assert [item_digest(x) for x in back] == [item_digest(x) for x in items]
    assert type(back[1]["meta"]) is collections.OrderedDict and type(back[1]["pair"]) is Pair
    assert back[1]["nums"][0] == 1 and type(back[1]["nums"][0]) is int and back[4]["mask"] is None
    for start in (1, CHUNK - 1, CHUNK, CHUNK + 43, CHUNK + 44):
        got = list(stream.open(stream.shards()[0], start))
        assert [item_digest(x) for x in got] == [item_digest(x) for x in items[start:CHUNK + 44]], start
    assert [x["nums"][0] for x in streams.tensor_shards(paths[2:], lambda x: x).open(str(paths[2]), 0)] == \
        list(range(2 * (CHUNK + 44), 700))


def test_a_tensor_shard_is_a_plain_safetensors_file(tmp_path):
    items = ({"x": torch.full((4,), float(i)), "y": i} for i in range(10))
    (path,) = streams.write_tensor_shards(items, tmp_path)
    with safe_open(str(path), framework="pt") as f:
        columns = {name: f.get_tensor(name) for name in f.keys()}
        assert f.metadata()["count"] == "10"
    assert columns["c0:x"].shape == (10, 4) and columns["c0:x"].dtype == torch.float32
    assert columns["c1:y"].tolist() == list(range(10))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(ITEMS, min_size=1, max_size=4))
def test_any_item_a_dataset_returns_reads_back_from_a_shard_of_its_own(tmp_path, items):
    folder = tmp_path / str(abs(hash(item_digest(items))))
    paths = streams.write_tensor_shards(items, folder, items_per_shard=1, overwrite=True)
    stream = streams.tensor_shards(paths)
    back = [x for shard in stream.shards() for x in stream.open(shard, 0)]
    assert [item_digest(x) for x in back] == [item_digest(x) for x in items]


def local_pair():
    return collections.namedtuple("Local", "a")(1)


@pytest.mark.parametrize("items,needle", [
    ([{"x": 1}, {"y": 1}], "item 1 at (the item itself) has the keys ['y'] where the items before it have "
                           "the keys ['x']"),
    ([{"x": 1}, {"x": "a"}], "item 1 at ['x'] is a str where the items before it have a int"),
    ([{"x": torch.zeros(2)}, {"x": torch.zeros(2, dtype=torch.int64)}],
     "item 1 at ['x'] has dtype int64 where the items before it have float32"),
    ([torch.zeros(2), torch.zeros(2, 1)], "item 1 at (the item itself) has 2 dimensions where the items "
                                          "before it have 1"),
    ([(1, 2), (1,)], "item 1 at (the item itself) has 1 elements where the items before it have 2 elements"),
    ([{"x": object()}], "item 0 at ['x'] is a builtins.object; store a tensor"),
    ([{"x": np.array([object()])}], "item 0 at ['x'] is a numpy array of Python objects"),
    ([{(1, 2): 0}], "item 0 at (the item itself) has the key (1, 2) (tuple); keys are str or int"),
    ([[1], [2**70]], "item 1 at [0] is the int 1180591620717411303424, beyond 64 bits"),
    ([local_pair()], "is a namedtuple test_tensor_shards:Local that cannot be imported by that name"),
    ([{"s": torch.zeros(2).to_sparse()}], "item 0 at ['s'] is a torch.sparse_coo tensor"),
])
def test_an_item_a_shard_cannot_hold_is_one_line_naming_it(tmp_path, items, needle):
    with pytest.raises(ConfigError) as e:
        streams.write_tensor_shards(items, tmp_path)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_shards_are_not_overwritten_unless_asked_and_a_foreign_file_is_named(tmp_path):
    streams.write_tensor_shards(range(5), tmp_path, items_per_shard=2)
    with pytest.raises(ConfigError, match="already holds 3 shard"):
        streams.write_tensor_shards(range(5), tmp_path)
    assert len(streams.write_tensor_shards(range(5), tmp_path, items_per_shard=5, overwrite=True)) == 1
    assert list(streams.tensor_shards(tmp_path).open(str(tmp_path / "shard-00000.safetensors"), 3)) == [3, 4]
    with pytest.raises(ConfigError, match="items_per_shard=0: must be >= 1"):
        streams.write_tensor_shards(range(5), tmp_path / "b", items_per_shard=0)
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ConfigError, match="other.safetensors is not a tensor shard"):
        streams.tensor_shards(tmp_path).open(str(tmp_path / "other.safetensors"), 0)


BATCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                torch.float32, torch.float64, torch.complex64]
NP_BATCH = ["?", "u1", "i2", "<i8", "<f2", "<f4", "<f8", "<c8", ">f4", "U2"]


@st.composite
def schemas(draw, depth=0):
    """An item's structure: what every item of a shard shares."""
    leaf = st.one_of(
        st.tuples(st.just("tensor"), st.sampled_from(BATCH_DTYPES), st.lists(st.integers(0, 3), max_size=2)),
        st.tuples(st.just("array"), st.sampled_from(NP_BATCH), st.lists(st.integers(1, 3), max_size=2)),
        st.tuples(st.just("npscalar"), st.sampled_from(NP_BATCH[:-1])),
        st.sampled_from([("int",), ("float",), ("bool",), ("str",), ("bytes",)]))
    if depth >= 2:
        return draw(leaf)
    inner = schemas(depth + 1)
    return draw(st.one_of(leaf, st.lists(inner, max_size=3).map(lambda v: ("tuple", v)),
                          st.lists(inner, max_size=3).map(lambda v: ("list", v)),
                          st.dictionaries(st.text("abc", max_size=2), inner, max_size=3).map(
                              lambda d: ("dict", d)),
                          st.tuples(inner, inner).map(lambda v: ("pair", v))))


def draw_item(data, schema):
    kind = schema[0]
    if kind == "tensor":
        return torch.full(schema[2], data.draw(st.integers(0, 1))).to(schema[1])
    if kind in ("array", "npscalar"):
        shape = schema[2] if kind == "array" else ()
        value = data.draw(st.integers(0, 5))
        arr = np.full(shape, str(value) if schema[1] == "U2" else value).astype(schema[1])
        return arr if kind == "array" else arr.reshape(-1)[0] if arr.size else arr[()]
    if kind in ("int", "float", "bool", "str", "bytes"):
        values = {"int": st.integers(-2**40, 2**40), "float": st.floats(allow_nan=False),
                  "bool": st.booleans(), "str": st.text(max_size=3), "bytes": st.binary(max_size=3)}
        return data.draw(values[kind])
    if kind == "dict":
        return {k: draw_item(data, v) for k, v in schema[1].items()}
    parts = [draw_item(data, v) for v in schema[1]]
    return Pair(*parts) if kind == "pair" else tuple(parts) if kind == "tuple" else parts


def _batchable(schema) -> bool:
    kind = schema[0]
    if kind in ("dict", "tuple", "list", "pair"):
        values = schema[1].values() if kind == "dict" else schema[1]
        return all(_batchable(v) for v in values)
    return not (kind == "array" and schema[1] in (">f4", "U2"))  # a numpy scalar is in native order


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(schemas(), st.integers(1, 5), st.data())
def test_a_micro_batch_read_whole_is_what_the_default_collate_makes_of_its_items(tmp_path, schema, n, data):
    """`take_batch` (the stream's micro-batch read as column slices, trainapp/core/stream.py) against torch's
    default_collate of the same items read one by one: the same batch, bit for bit; read item by item only
    where default_collate would not make a tensor of the column (strings in numpy, another byte order)."""
    items = [draw_item(data, schema) for _ in range(n + 2)]
    folder = tmp_path / str(abs(hash(item_digest(items))))
    (path,) = streams.write_tensor_shards(items, folder, overwrite=True)
    opened = streams.tensor_shards(folder).open(str(path), 1)
    got = opened.take_batch(n)
    if not _batchable(schema):
        assert got is None
        return
    assert got is not None, schema
    batch, last = got
    assert item_digest(batch) == item_digest(default_collate(items[1:n + 1]))
    assert item_digest(last) == item_digest(items[n])
    assert item_digest(next(opened)) == item_digest(items[n + 1])  # reading on one by one
