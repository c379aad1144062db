"""Items of every kind a Dataset returns (trainapp/core/items.py): the digest behind a stream's resume check,
as a property over generated items (hypothesis): equal items give equal digests whatever their memory
layout, one changed element, dtype, shape, key or type changes it, and every item survives a loader worker
and the resume check. Then the collate's one line for an item it cannot batch, and batches moved to a
device whatever container holds them."""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from trainapp import streams
from trainapp.config import ConfigError
from trainapp.core.data import LocatedItems, SeededItems
from trainapp.core.items import DefaultCollate, Items, item_digest
from trainapp.core.lanes import Deal, Piece
from trainapp.core.lane_reader import LaneReader, Source, keep
from trainapp.core.task import to_device

Pair = collections.namedtuple("Pair", "left right")
DTYPES = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64]
NP_DTYPES = ["?", "i1", "u1", "<i2", "<i4", "<i8", "<f2", "<f4", "<f8", "<c8", ">f4", "S3", "<U2"]


def _bits(data, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `dtype` and `shape` with drawn bit patterns (NaNs and negative zeros included)."""
    n = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.tensor(list(data.draw(st.binary(min_size=n * size, max_size=n * size))), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@st.composite
def tensors(draw):
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    return _bits(draw(st.data()), draw(st.sampled_from(DTYPES)), shape)


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    if dtype.kind == "b":
        raw = bytes(b % 2 for b in raw)
    if dtype.kind == "U":  # valid code points only
        text = draw(st.lists(st.text(max_size=2), min_size=n, max_size=n))
        return np.array(text, dtype=dtype).reshape(shape)
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


NP_SCALARS = st.builds(lambda a: a.reshape(-1)[0], arrays().filter(lambda a: a.size > 0))
LEAVES = st.one_of(tensors(), arrays(), NP_SCALARS, st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1),
                   st.floats(allow_nan=True), st.complex_numbers(allow_nan=False), st.text(max_size=5),
                   st.binary(max_size=5))
ITEMS = st.recursive(LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
    st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 9)), inner, max_size=3),
    st.builds(Pair, inner, inner)), max_leaves=6)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def relayout(x):
    """An equal item in other memory: tensors as strided views of a larger buffer, arrays in Fortran order
    or strided, dicts in reverse insertion order."""
    if isinstance(x, torch.Tensor):
        buf = torch.zeros((*x.shape, 2), dtype=x.dtype)
        buf[..., 1] = x
        view = buf[..., 1]  # every stride doubled, a storage offset of one element
        assert view.ndim == 0 or x.numel() < 2 or not view.is_contiguous()
        return view
    if isinstance(x, np.ndarray):
        if x.ndim > 1:
            return np.asfortranarray(x)
        buf = np.zeros((*x.shape, 2), dtype=x.dtype)
        buf[..., 1] = x
        return buf[..., 1]
    if isinstance(x, dict):
        return {k: relayout(x[k]) for k in reversed(list(x))}
    if isinstance(x, Pair):
        return Pair(*map(relayout, x))
    if isinstance(x, (list, tuple)):
        return type(x)(map(relayout, x))
    return x


def _leaves(x, path=()):
    """(path, value) of every leaf, and of every empty container."""
    if isinstance(x, (dict, list, tuple)) and not x:
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(x, (list, tuple)) and not isinstance(x, (str, bytes)):
        for i, v in enumerate(x):
            yield from _leaves(v, (*path, i))
    else:
        yield path, x


def _replace(x, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(x, dict):
        return {**x, head: _replace(x[head], rest, new)}
    values = list(x)
    values[head] = _replace(values[head], rest, new)
    return Pair(*values) if isinstance(x, Pair) else type(x)(values)


def changed(leaf, how: str):
    """`leaf` with one element, its dtype, its shape or its type changed (an empty container: one added)."""
    if isinstance(leaf, (dict, list, tuple)):
        return {0: 0} if isinstance(leaf, dict) else type(leaf)([0])
    if isinstance(leaf, torch.Tensor):
        if how == "dtype":
            return leaf.to(torch.float64 if leaf.dtype != torch.float64 else torch.float32)
        if how == "shape" or leaf.numel() == 0:
            return leaf.unsqueeze(0)
        flat = leaf.reshape(-1).clone().view(torch.uint8)
        flat[0] ^= 1
        return flat.view(leaf.dtype).reshape(leaf.shape)
    if isinstance(leaf, np.ndarray):
        if how == "shape" or leaf.size == 0:
            return leaf[None]
        if how == "dtype" and leaf.dtype.kind in "SU":
            return leaf.astype("O")
        if how == "dtype":
            with np.errstate(over="ignore"):
                return leaf.astype("<f8" if leaf.dtype != np.dtype("<f8") else "<f4")
        flat = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8).copy()
        flat[0] ^= 1
        return flat.view(leaf.dtype).reshape(leaf.shape)
    if isinstance(leaf, np.generic):
        return changed(np.array(leaf), how).reshape(-1)[0] if how == "element" else leaf.item()
    if isinstance(leaf, bool) or leaf is None:
        return 0 if leaf is None else not leaf
    if isinstance(leaf, int) and how == "element":
        return leaf + 1
    if isinstance(leaf, float) and how == "element" and math.isfinite(leaf):
        return math.nextafter(leaf, math.inf)
    if isinstance(leaf, (int, float, complex)):
        return str(leaf)
    return leaf + type(leaf)(b"x" if isinstance(leaf, bytes) else "x")


@FAST
@given(ITEMS)
def test_equal_items_have_equal_digests_whatever_their_memory_layout(item):
    assert item_digest(item) == item_digest(relayout(item))


@FAST
@given(ITEMS, st.data(), st.sampled_from(["element", "dtype", "shape"]))
def test_changing_one_element_dtype_shape_or_type_changes_the_digest(item, data, how):
    path, leaf = data.draw(st.sampled_from(list(_leaves(item))))
    other = changed(leaf, how)
    assert item_digest(_replace(item, path, other)) != item_digest(item), (path, leaf, other)


def test_digests_tell_kinds_and_boundaries_apart():
    assert item_digest([b"aB", b"c"]) != item_digest([b"a", b"Bc"])
    assert item_digest(Pair(1, 2)) != item_digest((1, 2)) != item_digest([1, 2])
    assert item_digest(1) != item_digest(True) != item_digest(1.0) != item_digest("1")
    assert item_digest(1) != item_digest(np.int64(1))
    assert item_digest(0.0) != item_digest(-0.0)
    assert item_digest({"a", "b", "c"}) == item_digest({"c", "b", "a"})  # one order, whatever the hash seed
    t = torch.tensor([1 + 2j, 3 - 1j])
    assert item_digest(t.conj()) == item_digest(t.conj().resolve_conj()) != item_digest(t)
    assert item_digest(torch.tensor(7)) == item_digest(torch.arange(8)[7])  # a 0-dim view at an offset


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ITEMS, min_size=2, max_size=5))
def test_every_item_survives_a_loader_worker_and_the_resume_check(items):
    """The items as one shard of a stream, read item by item by a loader worker (the items pickled to this
    process): each position's digest, made in the worker, is the digest of the item received here, and a
    reader reopened at each position passes the resume check and reads on with the next item."""
    stream = streams.Shards([0], lambda shard: items)
    source = Source(stream, [0], 0, True, 0, False)
    reader = LaneReader(source, Deal(0, [[Piece(0, 0, 0, None)]]), [0], 1, 0, 1, lambda batch: batch)
    entries = list(DataLoader(reader, batch_size=None, num_workers=1, collate_fn=keep))
    assert [e[0] for e in entries] == ["ok"] * len(items) + ["dry"]
    for k, (_, _, batch, pos, _) in enumerate(entries[:-1]):
        assert item_digest(batch[0]) == item_digest(items[k]) == pos[2] and pos[1] == k + 1
        it = source.open(Piece(0, 0, 0, None), pos[1], pos[2])  # ConfigError if the check failed
        rest = list(it)
        assert [item_digest(x) for x in rest] == [item_digest(x) for x in items[k + 1:]]


def _bad(items, where=lambda k: f"item {k + 40} of shard 'a'"):
    with pytest.raises(ConfigError) as e:
        DefaultCollate("mine")(Items(items, where))
    line = str(e.value)
    assert "\n" not in line and line.startswith("task.name='mine': ")
    return line


def test_an_item_the_default_collate_cannot_batch_is_named_with_its_key_path_and_type():
    x = torch.zeros(3)
    assert "item 41 of shard 'a' at ['y'] is a NoneType" in _bad([{"x": x, "y": 1}, {"x": x, "y": None}])
    assert "item 40 of shard 'a' at ['y'] is a NoneType" in _bad([{"x": x, "y": None}, {"x": x, "y": None}])
    line = _bad([{"x": x}, {"x": torch.zeros(4)}])
    assert "item 41 of shard 'a' at ['x'] is a float32 tensor of shape (4,) where item 40" in line
    assert "a mapping without the key 'y'" in _bad([{"x": x, "y": 1}, {"x": x}])
    assert "item 40 of shard 'a' at [1] is a numpy array of dtype <U1" in _bad([(x, np.array(["a"]))] * 2)
    assert "item 40 of shard 'a' at [0]['m'] is a object" in _bad([[{"m": object()}]] * 2)
    assert "the int 1180591620717411303424, beyond 64 bits" in _bad([{"n": 1}, {"n": 2**70}])
    assert "is a tuple of length 1 where item 40" in _bad([(1, 2), (3,)])


def test_map_style_items_reach_the_collate_with_their_indices():
    data = [{"x": torch.zeros(2)}] * 5 + [{"x": None}]
    seeded = SeededItems(data, seed=0)
    loader = DataLoader(seeded, batch_size=3, sampler=[0, 1, 2, 3, 4, 5], collate_fn=DefaultCollate("mine"))
    with pytest.raises(ConfigError, match=r"item 5 of the train set at \['x'\] is a NoneType"):
        list(loader)

    class Rows:  # a set with its own batch read (Hugging Face datasets' __getitems__)
        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise AssertionError("read one by one")

        def __getitems__(self, indices):
            return [{"v": i} if i != 2 else {"v": "two"} for i in indices]

    got = LocatedItems(Rows(), "val").__getitems__([3, 2])
    assert got == [{"v": 3}, {"v": "two"}] and got.where(1) == "item 2 of the val set"


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    lengths: list
    name: str = "b"


class Encoding(collections.UserDict):
    """A mapping that is not a dict (as Hugging Face's BatchEncoding)."""


def test_to_device_moves_every_tensor_whatever_container_holds_it():
    meta = torch.device("meta")
    batch = {"enc": Encoding(ids=torch.ones(2)), "pair": Pair(torch.ones(1), [torch.ones(1), 3]),
             "data": Batch(torch.ones(2), [torch.ones(1)]), "text": "abc"}
    moved = to_device(batch, meta)
    assert type(moved["enc"]) is Encoding and moved["enc"]["ids"].is_meta
    assert type(moved["pair"]) is Pair and moved["pair"].left.is_meta and moved["pair"].right[0].is_meta
    assert type(moved["data"]) is Batch and moved["data"].tokens.is_meta and moved["data"].lengths[0].is_meta
    assert moved["text"] == "abc" and moved["pair"].right[1] == 3
