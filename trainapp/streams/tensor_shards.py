"""Tensor shards: the fast path for streams. A shard is one safetensors file whose columns hold a field of
every item (`x` of all items stacked; variable shapes flattened with their offsets), so reading an item
is slicing, not decoding (the reader: trainapp/streams/tensor_reader.py). This module writes them.

    paths = streams.write_tensor_shards(items, "data/train", items_per_shard=4096)   # once, offline
    train = streams.tensor_shards("data/train")                                      # in datasets(ctx)

An item is what a map-style dataset returns: tensors (any dtype, rank and shape; shapes may differ between
items), numpy arrays and scalars, Python bools, ints, floats and complex numbers, strings, bytes, None,
and dicts (string or int keys), lists, tuples and namedtuples (of a module-level class) of them. Every
item of a shard has the same structure (the same keys, types and dtypes; a field may be None in some).
An item reads back as it was written: the same types, dtypes, shapes and values. The file is a plain
safetensors file (`safetensors.safe_open` reads its columns; the item structure is in its metadata).
"""

from __future__ import annotations

import collections
import importlib
import itertools
import json
import os
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from safetensors.torch import save_file

from trainapp.config import ConfigError

FORMAT = "trainapp-tensor-shard/1"
SAFETENSORS_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32,
                      torch.uint32, torch.int64, torch.uint64, torch.float16, torch.bfloat16, torch.float32,
                      torch.float64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2)
"""The dtypes a safetensors file holds as they are; a column of another (complex128) is stored as bytes."""
SCALARS = MappingProxyType({bool: "bool", int: "int", float: "float", complex: "complex"})
KINDS = ("a tensor, a numpy array or scalar, a bool, int, float, complex, str, bytes or None, or a dict, "
         "list, tuple or namedtuple of them")


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def _path_str(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path) or "(the item itself)"


class _Bad(ConfigError):
    def __init__(self, index: int, path: tuple[Any, ...], what: str):
        super().__init__(f"write_tensor_shards: item {index} at {_path_str(path)} {what}")


def _describe(x: Any, path: tuple[Any, ...], index: int) -> dict[str, Any]:
    """The structure of `x` (no values): what every item of a shard must share."""
    if x is None:
        return {"k": "none"}
    if type(x) in SCALARS:
        return {"k": SCALARS[type(x)]}
    if type(x) in (str, bytes):
        return {"k": type(x).__name__}
    if isinstance(x, (torch.Tensor, np.ndarray, np.generic)):
        return _describe_array(x, path, index)
    return _describe_container(x, path, index)


def _describe_all(x: Any, path: tuple[Any, ...], index: int) -> list[dict[str, Any]]:
    return [_describe(v, (*path, i), index) for i, v in enumerate(x)]


def _describe_array(x: Any, path: tuple[Any, ...], index: int) -> dict[str, Any]:
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.is_nested:
            raise _Bad(index, path, f"is a {x.layout} tensor; store its dense values (.to_dense())")
        return {"k": "tensor", "dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape),
                "ndim": x.ndim}
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise _Bad(index, path, "is a numpy array of Python objects; store numbers, or strings as str")
        return {"k": "array", "dtype": np.lib.format.dtype_to_descr(x.dtype), "shape": list(x.shape),
                "ndim": x.ndim}
    if x.dtype.hasobject:
        raise _Bad(index, path, f"is a {type(x).__name__}; store {KINDS}")
    return {"k": "npscalar", "dtype": np.lib.format.dtype_to_descr(x.dtype), "shape": [], "ndim": 0}


def _describe_container(x: Any, path: tuple[Any, ...], index: int) -> dict[str, Any]:
    if isinstance(x, (dict, collections.OrderedDict)):
        bad = [k for k in x if type(k) not in (str, int)]
        if bad:
            raise _Bad(index, path, f"has the key {bad[0]!r} ({type(bad[0]).__name__}); keys are str or int")
        return {"k": "dict", "type": type(x).__name__ if type(x) is collections.OrderedDict else "dict",
                "keys": list(x), "v": [_describe(v, (*path, k), index) for k, v in x.items()]}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        cls = f"{type(x).__module__}:{type(x).__qualname__}"
        try:
            namedtuple_class(cls)
        except ConfigError:
            raise _Bad(index, path, f"is a namedtuple {cls} that cannot be imported by that name; define it "
                                    "at module level") from None
        return {"k": "namedtuple", "cls": cls, "v": _describe_all(x, path, index)}
    if type(x) in (tuple, list):
        return {"k": type(x).__name__, "v": _describe_all(x, path, index)}
    raise _Bad(index, path, f"is a {type(x).__module__}.{type(x).__qualname__}; store {KINDS}")


def namedtuple_class(cls: str) -> Any:
    module, _, qualname = cls.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as e:
        raise ConfigError(f"a tensor shard's items are namedtuples {cls}, which cannot be imported here "
                          f"({type(e).__name__}: {e})") from None
    return obj


def _merge(a: dict[str, Any], b: dict[str, Any], path: tuple[Any, ...], index: int) -> dict[str, Any]:
    """One structure for two items' (`b` is item `index`'s): a field None in one is optional; a tensor or
    array whose shapes differ is ragged (its shape None)."""
    if a == b:
        return a
    if a["k"] == "none" or b["k"] == "none":
        some = b if a["k"] == "none" else a
        return {**some, "opt": True}
    if a["k"] != b["k"] or a.get("cls") != b.get("cls") or a.get("type") != b.get("type"):
        raise _Bad(index, path, f"is a {_kind(b)} where the items before it have a {_kind(a)}")
    if a["k"] in ("tensor", "array", "npscalar"):
        if a["dtype"] != b["dtype"]:
            raise _Bad(index, path, f"has dtype {b['dtype']} where the items before it have {a['dtype']}")
        if a["ndim"] != b["ndim"]:
            raise _Bad(index, path, f"has {b['ndim']} dimensions where the items before it have {a['ndim']}")
        return {**a, "shape": a["shape"] if a["shape"] == b["shape"] else None,
                "opt": a.get("opt", False) or b.get("opt", False)}
    if a.get("keys") != b.get("keys") or len(a.get("v", [])) != len(b.get("v", [])):
        raise _Bad(index, path, f"has {_fields(b)} where the items before it have {_fields(a)}")
    keys = a.get("keys") or list(range(len(a["v"])))
    return {**a, "opt": a.get("opt", False) or b.get("opt", False),
            "v": [_merge(x, y, (*path, k), index) for k, x, y in zip(keys, a["v"], b["v"])]}


def _kind(node: dict[str, Any]) -> str:
    return {"tensor": f"{node.get('dtype')} tensor", "array": "numpy array", "npscalar": "numpy scalar",
            "namedtuple": f"namedtuple {node.get('cls')}", "none": "None"}.get(node["k"], node["k"])


def _fields(node: dict[str, Any]) -> str:
    return f"the keys {node['keys']}" if "keys" in node else f"{len(node['v'])} elements"


def leaves(node: dict[str, Any], path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], dict]]:
    """The structure's nodes that own columns (leaves, and optional containers for their mask), in order."""
    if node["k"] in ("dict", "list", "tuple", "namedtuple"):
        if node.get("opt"):
            yield path, node
        keys = node.get("keys") or range(len(node["v"]))
        for k, child in zip(keys, node["v"]):
            yield from leaves(child, (*path, k))
    elif node["k"] != "none":
        yield path, node


def _name(path: tuple[Any, ...], n: int) -> str:
    return f"c{n}:" + (".".join(str(p) for p in path) or "item")


def _value(item: Any, path: tuple[Any, ...]) -> Any:
    """The value at `path` in `item`, or None when a field on the way is None (optional)."""
    for p in path:
        if item is None:
            return None
        item = item[p]
    return item


def _columns(node: dict[str, Any], values: list[Any], path: tuple[Any, ...],
             first: int) -> dict[str, torch.Tensor]:
    """A leaf's columns (the suffixes: '' the values, '.offsets' and '.shapes' when ragged, '.present' when
    optional) from the leaf's value in every item (item `first` the first)."""
    out: dict[str, torch.Tensor] = {}
    if node.get("opt"):
        out[".present"] = torch.tensor([v is not None for v in values], dtype=torch.bool)
    k = node["k"]
    if k in ("dict", "list", "tuple", "namedtuple"):
        return out
    if k in ("str", "bytes"):
        raw = [b"" if v is None else v.encode("utf-8", "surrogatepass") if k == "str" else v for v in values]
        out[""] = torch.frombuffer(bytearray(b"".join(raw)) or bytearray(1), dtype=torch.uint8)
        out[".offsets"] = torch.tensor([0, *itertools.accumulate(len(r) for r in raw)], dtype=torch.int64)
        return out
    if k in SCALARS.values():
        wide = [i for i, v in enumerate(values) if k == "int" and v is not None and not -2**63 <= v < 2**63]
        if wide:
            raise _Bad(first + wide[0], path, f"is the int {values[wide[0]]}, beyond 64 bits")
        dtype = {"bool": torch.bool, "int": torch.int64, "float": torch.float64,
                 "complex": torch.complex128}[k]
        out[""] = torch.tensor([v if v is not None else 0 for v in values], dtype=dtype)
        return out
    tensors = [_as_tensor(node, v) for v in values]
    fill = torch.zeros_like(next(t for t in tensors if t is not None))
    if node["shape"] is not None:
        out[""] = torch.stack([t if t is not None else fill for t in tensors])
    else:
        flat = [t.reshape(-1) if t is not None else fill.reshape(-1)[:0] for t in tensors]
        out[""] = torch.cat(flat)
        out[".offsets"] = torch.tensor([0, *itertools.accumulate(f.numel() for f in flat)], dtype=torch.int64)
        shapes = [list(v.shape) if v is not None else [0] * node["ndim"] for v in values]
        out[".shapes"] = torch.tensor(shapes, dtype=torch.int64).reshape(len(values), node["ndim"])
    return out


def _as_tensor(node: dict[str, Any], v: Any) -> torch.Tensor | None:
    """A tensor leaf's value as it is stored (contiguous, on the CPU); an array's or numpy scalar's as its
    bytes, one row per item (numpy has dtypes torch lacks: strings, records, other byte orders)."""
    if v is None:
        return None
    if node["k"] == "tensor":
        return v.detach().cpu().contiguous()
    a = np.ascontiguousarray(v)
    raw = np.frombuffer(a.tobytes(), dtype=np.uint8).copy()  # b"" for a dtype of no bytes ('S0')
    return torch.from_numpy(raw).reshape(*a.shape, a.dtype.itemsize)


def write_tensor_shards(items: Iterable[Any], folder: str | Path, items_per_shard: int = 1024,
                        prefix: str = "shard", overwrite: bool = False) -> list[Path]:
    """Write `items` (any iterable: a list, a generator, a map-style dataset read in order) as tensor shards
    `FOLDER/PREFIX-00000.safetensors`, ... of `items_per_shard` items each (the last may hold fewer); each
    file is written whole or not at all. Returns the paths. An item that cannot be stored, or whose
    structure differs from the items before it in its shard, is a ConfigError naming the item and the key."""
    if items_per_shard < 1:
        raise ConfigError(f"write_tensor_shards: items_per_shard={items_per_shard}: must be >= 1")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    old = sorted(out.glob(f"{prefix}-*.safetensors"))
    if old and not overwrite:
        raise ConfigError(f"write_tensor_shards: {out} already holds {len(old)} shard(s) named {prefix}-*; "
                          "write to another folder, or pass overwrite=True to replace them")
    for path in old:
        path.unlink()
    paths: list[Path] = []
    it = iter(items)
    while batch := list(itertools.islice(it, items_per_shard)):
        path = out / f"{prefix}-{len(paths):05d}.safetensors"
        _write_shard(batch, path, first=len(paths) * items_per_shard)
        paths.append(path)
    if not paths:
        raise ConfigError("write_tensor_shards: no items were given")
    return paths


def _write_shard(items: list[Any], path: Path, first: int) -> None:
    node = _describe(items[0], (), first)
    for i, item in enumerate(items[1:], first + 1):
        node = _merge(node, _describe(item, (), i), (), i)
    columns: dict[str, torch.Tensor] = {}
    raw: dict[str, list[Any]] = {}
    for n, (where, leaf) in enumerate(leaves(node)):
        leaf["c"] = _name(where, n)
        made = _columns(leaf, [_value(item, where) for item in items], where, first)
        for suffix, t in made.items():
            name = leaf["c"] + suffix
            if t.dtype not in SAFETENSORS_DTYPES:
                raw[name] = [str(t.dtype).removeprefix("torch."), list(t.shape)]
                t = t.contiguous().view(torch.uint8).reshape(t.shape[0] if t.ndim else 1, -1)
            columns[name] = t.contiguous()
    meta = {"format": FORMAT, "count": str(len(items)), "first": str(first), "items": json.dumps(node),
            "raw": json.dumps(raw)}
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(columns, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a write that failed (a full disk) leaves no part of a shard
