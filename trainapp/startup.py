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


class GcPause:
    """The collector paused from now until `end()` (nothing to do where it was off already: the user's
    choice). The rank's guard keeps it (trainapp/faults/guard.py); `run_rank` ends it once the parts are
    built, or when the start fails."""

    def __init__(self) -> None:
        self.active = gc.isenabled()
        if self.active:
            gc.disable()

    def end(self) -> None:
        """The collector back on, the start-up's objects frozen; once."""
        if self.active:
            self.active = False
            gc.freeze()
            gc.enable()
