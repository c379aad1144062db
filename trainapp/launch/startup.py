"""A training process's start-up with Python's cyclic garbage collector paused.

Importing torch, and torch._dynamo (which every torch optimizer imports when it is made), creates
hundreds of thousands of objects; each allocation threshold crossed then runs a collection that walks
them all, and finds almost nothing to free. Paused from the entry point until the rank's parts are built,
a process reaches its first step about 0.5 s sooner on these 2-core machines (2.7 s -> 2.2 s for
`import torch, torch._dynamo`): time every start and every restart after a lost worker pays, on its
critical path. Reference counting still frees everything that is not in a cycle meanwhile.

Turned back on, the collector would first walk every object the start-up made (about 0.2 s, in the first
step); `gc.freeze()` moves them to the permanent generation instead, which later collections skip. What
the start-up left in cycles stays allocated: a few MB at most, against the seconds every start saves.
"""

from __future__ import annotations

import gc

_paused = False


def pause_gc() -> None:
    """Pause the cyclic collector for the start-up (a no-op where it was off already: the user's)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_gc() -> None:
    """Turn the collector back on if `pause_gc` paused it, the start-up's objects frozen: the parts are
    built (or the start failed)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
