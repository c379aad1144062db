"""A live resize of an elastic Ray run is a notice (docs/ray.md, "Elastic runs"): when Ray Train decides
to resize a running worker group (a node came back, or more room appeared), it would stop the group
at once and restart it from the last snapshot, redoing every step since. Instead the controller's
`ResizeSnapshot` callback (trainapp/launch/ray/compat.py) asks rank 0 of the running workers, through a
file in the run's lease folder, to stop at the next step with a snapshot; the workers agree on the
step, snapshot it, write a `resized` record and answer; then Ray Train replaces the group and the new
one resumes from that snapshot, at the same global sample and with the same global batch
(trainapp/core/layout.py): no step redone, the same math.

Imports neither torch nor Ray: the controller and the workers both use it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

REQUEST = "resize-request.json"
DONE = "resize-done.json"


def _read(store, name: str) -> dict[str, Any] | None:
    raw = store.read(name)
    if not raw:
        return None
    try:
        out = json.loads(raw)
    except ValueError:  # being replaced where there is no atomic rename: the next poll reads it
        return None
    return out if isinstance(out, dict) else None


def ask(store, was: int, to: int) -> str:
    """Ask the running workers to stop for a resize from `was` to `to` workers; the request's id."""
    rid = uuid.uuid4().hex[:12]
    store.replace(REQUEST, json.dumps({"id": rid, "from": was, "to": to, "at": round(time.time(), 3)}).encode())
    return rid


def asked(store) -> dict[str, Any] | None:
    """The resize request standing now ({id, from, to, at}), or None."""
    return _read(store, REQUEST)


def answer(store, rid: str, step: int | None, snapshot: str | None) -> None:
    """Rank 0, once the snapshot of `step` is written (None: this attempt trained no step yet)."""
    store.replace(DONE, json.dumps({"id": rid, "step": step, "snapshot": snapshot,
                                    "at": round(time.time(), 3)}).encode())


def wait(store, rid: str, timeout_s: float, poll_s: float = 0.2) -> dict[str, Any] | None:
    """The answer to request `rid`, or None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = _read(store, DONE)
        if done and done.get("id") == rid:
            return done
        time.sleep(poll_s)
    return None


def clear(store, rid: str) -> None:
    """Withdraw request `rid` (answered or given up on): the next group must not act on it."""
    standing = asked(store)
    if standing and standing.get("id") == rid:
        store.delete(REQUEST)
