"""Logging with the rank in every line (metrics.jsonl is trainapp/observe/metrics.py's).

Info goes out from rank 0 only; other ranks log warnings and errors. Log lines go through tqdm.write
so they do not tear the progress bar.
"""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm

FIRST_STEP = "first step of this attempt trained"
"""Rank 0's line once an attempt has trained its first step (trainapp/observe/records.py): the Ray driver
holds Ray's output back until it reads it (trainapp/launch/ray/output.py)."""


class _TqdmHandler(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup(rank: int, world_size: int) -> None:
    handler = _TqdmHandler(sys.stderr)
    width = len(str(max(world_size - 1, 0)))
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s [rank {rank:>{width}}] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger("trainapp")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False


def setup_from_env() -> None:
    """Early logging, before the process group exists: ranks as the launcher exported them."""
    def num(name: str, default: int) -> int:
        raw = os.environ.get(name, "")
        return int(raw) if raw.isdigit() else default  # dist.setup reports malformed values
    setup(num("RANK", 0), num("WORLD_SIZE", 1))
