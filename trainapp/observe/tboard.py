"""TensorBoard event files of a run (`observe.tensorboard`): rank 0 writes the scalars of its records
under `run.dir/tb`, one timeline across restarts.

TensorBoard is an optional extra (`pip install 'trainapp[tensorboard]'`, like matplotlib for the
report); the writer is torch's `torch.utils.tensorboard.SummaryWriter`.

One timeline: a restart resumes from a snapshot some steps behind the last one logged. Its writer
opens a new event file with `purge_step` = the first step it will redo, and TensorBoard hides the
earlier files' events from that step on, so redone steps are drawn once. Events are flushed at every
snapshot: those a SIGKILL could lose are only ever steps after the newest snapshot, which the
restart logs again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainapp.config import ConfigError

DIR = "tb"


def check() -> None:
    """Every rank, before training: the package imports, or one line saying how to get it."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError("observe.tensorboard=true needs the tensorboard package: pip install "
                          "'trainapp[tensorboard]' (or set observe.tensorboard=false)") from None


class Board:
    """Scalars to `RUN_DIR/tb` (rank 0)."""

    def __init__(self, run_dir: str | Path, resumed_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / DIR),
                                    purge_step=resumed_step + 1 if resumed_step else None, flush_secs=30)

    def scalars(self, prefix: str, step: int, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{name}", value, step)

    def ranks(self, step: int, ranks: list[dict[str, Any]]) -> None:
        """Each rank's step time and own work (the step without waiting for peers), one tag per rank."""
        for r in ranks:
            self.writer.add_scalar(f"ranks/step_ms/rank_{r['rank']}", r["step_ms"], step)
            self.writer.add_scalar(f"ranks/busy_ms/rank_{r['rank']}", r["busy_ms"], step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
