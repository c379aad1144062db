"""What trainapp does with one item of the user's data, whatever it holds: its digest (the stream's resume
check, trainapp/core/stream.py), the collate that says which item it could not batch, and where items came
from (`Items`).

An item is anything a map-style `Dataset.__getitem__` returns or a stream yields: tensors of any dtype,
rank (0-dim included) and memory layout, numpy arrays and scalars, Python scalars, strings, bytes, None,
and dicts, lists, tuples and namedtuples of them. torch's default collate batches most of these; what it
cannot batch is named in one line (the item, its key path, its type), not a traceback from inside torch.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import hashlib
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import default_collate

from trainapp.config import ConfigError
from trainapp.errors import first_line

DOCS = "docs/your-own-model.md#items"


def item_digest(item: Any) -> str:
    """A digest of an item's content: equal for equal items whatever their memory layout (a transposed or
    sliced tensor, a Fortran-ordered array, a dict's key order), different when one element, a dtype, a
    shape, a type or a key differs. The same in every process (no `hash()`, no set order)."""
    h = hashlib.blake2b(digest_size=12)
    _feed(h, item, 0)
    return h.hexdigest()


def _tag(h: Any, kind: str, raw: bytes | memoryview | np.ndarray = b"") -> None:
    # Each leaf says its kind and length first: no two different items concatenate to the same bytes.
    size = raw.nbytes if isinstance(raw, (memoryview, np.ndarray)) else len(raw)
    h.update(f"{kind}:{size}:".encode())
    h.update(raw)


def _feed(h: Any, x: Any, depth: int) -> None:
    if depth > 100:
        raise ValueError("an item nested more than 100 levels deep (does it contain itself?)")
    if isinstance(x, torch.Tensor):
        _tensor(h, x, depth)
    elif isinstance(x, np.ndarray):
        _array(h, x, depth)
    elif isinstance(x, np.generic):  # before float and str: np.float64 is a float, np.str_ a str
        a = _native(np.asarray(x))
        _tag(h, f"N{a.dtype.str}", a.reshape(-1).view(np.uint8))
    elif x is None or isinstance(x, (bool, int, float, complex)):
        _tag(h, type(x).__name__, (x.hex() if isinstance(x, float) else repr(x)).encode())
    elif isinstance(x, str):
        _tag(h, "s", x.encode("utf-8", "surrogatepass"))
    elif isinstance(x, (bytes, bytearray, memoryview)):
        _tag(h, "b", bytes(x))
    else:
        _container(h, x, depth)


def _container(h: Any, x: Any, depth: int) -> None:
    if isinstance(x, collections.abc.Mapping):
        _tag(h, f"D{len(x)}")
        for k in sorted(x, key=item_digest):  # one order for equal dicts, whatever their insertion order
            _feed(h, k, depth + 1)
            _feed(h, x[k], depth + 1)
    elif isinstance(x, collections.abc.Sequence):  # lists, tuples, namedtuples (str and bytes: leaves)
        named = type(x).__qualname__ if type(x) not in (list, tuple) else type(x).__name__
        _tag(h, f"L{named}{len(x)}")
        for v in x:
            _feed(h, v, depth + 1)
    elif isinstance(x, (set, frozenset)):
        _tag(h, f"S{len(x)}")
        for d in sorted(item_digest(v) for v in x):  # a set's order changes with the process's hash seed
            _tag(h, "d", d.encode())
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        _tag(h, f"C{type(x).__qualname__}")
        for f in dataclasses.fields(x):
            _feed(h, f.name, depth + 1)
            _feed(h, getattr(x, f.name), depth + 1)
    else:
        _object(h, x, depth)


def _object(h: Any, x: Any, depth: int) -> None:
    """Any other object (a PIL image, a user's class) by what pickle would store of it, walked as an item:
    a pickle's bytes may hold a set in the process's hash order."""
    try:
        reduced = x.__reduce_ex__(4)
    except Exception as e:
        raise TypeError(f"a {type(x).__qualname__} cannot be read as data ({first_line(e)})") from None
    if isinstance(reduced, str):  # a global (a function, a class): its name
        _tag(h, "G", f"{type(x).__module__}.{reduced}".encode())
        return
    _tag(h, f"O{type(x).__module__}.{type(x).__qualname__}{len(reduced)}")
    for part in reduced[1:]:  # args, state, list items, dict items: the callable is the type above
        _feed(h, list(part) if isinstance(part, collections.abc.Iterator) else part, depth + 1)


def _tensor(h: Any, x: torch.Tensor, depth: int) -> None:
    t = x.detach()
    if t.is_nested:
        _tag(h, f"TN{t.dtype}{t.size(0)}")
        for part in t.unbind():
            _tensor(h, part, depth + 1)
        return
    if t.layout != torch.strided:  # sparse: its values, as a dense tensor
        t = t.to_dense()
    if t.is_quantized:
        _tag(h, f"TQ{t.qscheme()}")
        t = t.dequantize()
    flat = t.reshape(-1) if t.device.type == "cpu" and t.is_contiguous() and t.dim() else None
    if flat is None or flat.stride(0) != 1 or t.is_conj() or t.is_neg():
        # A fresh flat copy: 0-dim tensors, conjugate and negative views, any strides (contiguous() keeps
        # the strides of a tensor of one element or none, which a view as bytes refuses).
        flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.cpu().resolve_conj().resolve_neg().reshape(-1))
    _tag(h, f"T{t.dtype}{tuple(t.shape)}", flat.view(torch.uint8).numpy())


def _array(h: Any, x: np.ndarray, depth: int) -> None:
    if x.dtype.hasobject:  # the bytes of an object array are pointers: its elements instead
        _tag(h, f"AO{x.shape}")
        for v in x.reshape(-1):
            _feed(h, v, depth + 1)
        return
    a = _native(x)
    _tag(h, f"A{a.dtype.str}{a.shape}", np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _native(a: np.ndarray) -> np.ndarray:
    """`a` in this machine's byte order: byte order is layout, not content (and numpy's pickle of a 0-dim
    array changes it)."""
    native = a.dtype.newbyteorder("=")
    return a if native == a.dtype else a.astype(native)


class Items(list):
    """A list of items that knows where each came from (`where(k)`: "item 17 of shard 'a.tar'", "item 523
    of the train set"), so that the collate can name the one it cannot batch."""

    def __init__(self, items: Any, where: Callable[[int], str]):
        super().__init__(items)
        self.where = where

    def __reduce__(self) -> tuple[Any, ...]:
        # A collate that returns the list itself sends it from a loader worker: a plain list then.
        return list, (list(self),)


def where_of(items: Any, k: int) -> str:
    where = getattr(items, "where", None)
    return where(k) if callable(where) else f"item {k} of a batch"


class DefaultCollate:
    """torch's default_collate; a batch it cannot make is one ConfigError naming the task, the item, its key
    path and its type."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, items: list[Any]) -> Any:
        try:
            return default_collate(items)
        except Exception as e:  # TypeError, RuntimeError, KeyError, ...: which item, found below
            raise ConfigError(explain(self.name, items, e)) from None


def explain(name: str, items: list[Any], e: BaseException) -> str:
    """The one line for a batch default_collate refused with `e`."""
    fix = f"change the item, or give the task a collate(items) method that batches it ({DOCS})"
    bad = find_bad(items)
    if bad is None:
        return (f"task.name={name!r}: the default collate cannot batch {where_of(items, 0)} and the "
                f"{len(items) - 1} after it ({first_line(e)}); {fix}")
    k, path, what = bad
    at = f" at {path}" if path else ""
    return (f"task.name={name!r}: {where_of(items, k)}{at} is {what}, which the default collate cannot "
            f"batch; {fix}")


def _type(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).removeprefix('torch.')} tensor of shape {tuple(x.shape)}"
    if isinstance(x, np.ndarray):
        return f"a numpy array of dtype {x.dtype} and shape {x.shape}"
    module = type(x).__module__
    return f"a {'' if module == 'builtins' else module + '.'}{type(x).__qualname__}"


def _kind(x: Any) -> str | None:
    """What default_collate does with `x`, in its order of checks (None: it raises)."""
    if isinstance(x, torch.Tensor):
        ok = x.layout == torch.strided and not x.is_nested
        return "tensor" if ok else None
    if isinstance(x, np.ndarray):
        return None if x.dtype.kind in "SaUO" or x.dtype.hasobject else "array"
    if isinstance(x, (np.bool_, np.number)):
        return "number"
    if isinstance(x, (float, int)):
        return "number"
    if isinstance(x, (str, bytes)):
        return "text"
    if isinstance(x, collections.abc.Mapping):
        return "mapping"
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return "sequence"
    if isinstance(x, collections.abc.Sequence):
        return "sequence"
    return None


def find_bad(items: list[Any], path: str = "") -> tuple[int, str, str] | None:
    """(k, key path, what) of the first item that default_collate cannot batch with the others (an
    unsupported type, a type, shape or dtype that differs from the first item's, a missing key, a sequence
    of another length), or None."""
    first = items[0]
    kind = _kind(first)
    if kind is None:
        return 0, path, _type(first)
    if kind == "text":  # a list of whatever the items hold there
        return None
    for k, v in enumerate(items):
        same = _kind(v) == kind and (kind not in ("tensor", "array")
                                     or (v.shape, v.dtype) == (first.shape, first.dtype))
        if not same:
            return k, path, f"{_type(v)} where {where_of(items, 0)} has {_type(first)}"
    if kind == "mapping":
        return _mapping(items, path)
    if kind == "sequence":
        return _sequence(items, path)
    if kind == "number":
        wide = [k for k, v in enumerate(items) if isinstance(v, int) and not -2**63 <= v < 2**64]
        return (wide[0], path, f"the int {items[wide[0]]}, beyond 64 bits") if wide else None
    return None


def _mapping(items: list[Any], path: str) -> tuple[int, str, str] | None:
    for key in items[0]:
        missing = [k for k, v in enumerate(items) if key not in v]
        if missing:
            return missing[0], path, f"a mapping without the key {key!r} that {where_of(items, 0)} has"
        bad = find_bad(Items([v[key] for v in items], functools.partial(where_of, items)), f"{path}[{key!r}]")
        if bad:
            return bad
    return None


def _sequence(items: list[Any], path: str) -> tuple[int, str, str] | None:
    n = len(items[0])
    for k, v in enumerate(items):
        if len(v) != n:
            return k, path, f"a {type(v).__qualname__} of length {len(v)} where {where_of(items, 0)} has {n}"
    for i in range(n):
        bad = find_bad(Items([v[i] for v in items], functools.partial(where_of, items)), f"{path}[{i}]")
        if bad:
            return bad
    return None
