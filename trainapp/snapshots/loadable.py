"""Whether a state can come back from a storage snapshot: `state.pt` is read with
`torch.load(weights_only=True)` (trainapp/snapshots/store.py), which refuses what it does not know
(a numpy array or scalar, a dataclass, a defaultdict, most objects), while `torch.save` writes them
all. A run whose state holds one of them writes snapshots it can never resume from, and finds out at
its first restart. `refusal` finds such a value before the first step.

The check loads the state's skeleton (every plain tensor left out), so it costs what the state's
structure costs, not its bytes: milliseconds for a ResNet-50's model and optimizer. Before the first step
it catches a value that is there from the start; at every storage snapshot, one that came later (a
running mean that became a numpy array at the first batch).
"""

from __future__ import annotations

import copy
import io
import re
from typing import Any

import torch


def same_kind(obj: dict, values: dict) -> dict:
    """`values` (`obj`'s keys) in a mapping of `obj`'s own kind, as torch.save keeps it: a module's state
    dict is an OrderedDict whose `_metadata` holds each module's version (what `_load_from_state_dict`
    migrates old keys by); a task's state may hold a Counter or a defaultdict. A kind that cannot be
    copied: a dict."""
    if type(obj) is dict:
        return values
    try:
        out = copy.copy(obj)
        for k, v in values.items():  # not update(): a Counter's adds; the keys are obj's, its order stays
            out[k] = v
    except Exception:
        return values
    return out


def _skeleton(obj: Any) -> Any:
    if type(obj) is torch.Tensor:  # any dtype loads; a subclass (a library's quantized tensor) may not
        return None
    if isinstance(obj, dict):  # its own kind: weights_only takes an OrderedDict, not a defaultdict
        return same_kind(obj, {k: _skeleton(v) for k, v in obj.items()})
    if type(obj) in (list, tuple):
        return type(obj)(_skeleton(v) for v in obj)
    return obj


def _refused(obj: Any) -> str | None:
    """Why `obj` does not come back from torch.save then torch.load(weights_only=True), else None."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except Exception as e:
        return f"which torch.save cannot write ({e.__class__.__name__}: {_first_line(e)})"
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as e:
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        return ("which torch.load(weights_only=True) will not load back ("
                + (f"it does not allow {named.group(1)}" if named else
                   f"{e.__class__.__name__}: {_first_line(e)}") + ")")
    return None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:160]


def _first(obj: Any, where: str) -> tuple[str, Any, str | None]:
    """(key path, value, why) of the innermost refused value in `obj`, which is refused as a whole: a
    refused child's, else `obj` itself (its own kind is what is refused: a defaultdict, a dataclass)."""
    children = obj.items() if isinstance(obj, dict) else enumerate(obj) if type(obj) in (list, tuple) else ()
    for k, v in children:
        if _refused(_skeleton(v)) is not None:
            return _first(v, f"{where}[{k!r}]")
    return where, obj, _refused(_skeleton(obj))


def refusal(state: dict[str, Any]) -> str | None:
    """None when a snapshot of `state` loads back; else one phrase naming the first value it would not:
    its key path (`task['mean']`), its type and torch's reason."""
    if _refused(_skeleton(state)) is None:  # one round trip when it loads, as it nearly always does
        return None
    for name, part in state.items():
        if _refused(_skeleton(part)) is not None:
            where, value, why = _first(part, str(name))
            kind = type(value)
            return f"{where} is a {kind.__module__}.{kind.__qualname__}, {why}"
    return "the state as a whole is refused"
