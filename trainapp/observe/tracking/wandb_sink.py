"""Weights & Biases as a tracker (`observe.wandb_project`). Entity, mode and key are W&B's own
environment variables (`WANDB_ENTITY`, `WANDB_MODE`, `WANDB_API_KEY`), read by `wandb.init` itself.

One W&B run per run directory: its id is chosen here, kept in the run directory before the run starts,
and every attempt opens it again with `resume="allow"`. W&B keeps no mark a resumed offline run can read,
so how far the metrics go is the sender's own mark in the run directory (tracking.json); a step at or
below one W&B already holds is dropped by W&B itself (its steps only grow), so a batch sent twice
across a crash is not drawn twice once synced.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainapp.observe.tracking.lineage import Row


class WandbSink:
    name = "wandb"

    def __init__(self, project: str, run_dir: Path, run_name: str) -> None:
        self.where = f"wandb project {project}"
        self.project, self.run_dir, self.run_name = project, run_dir, run_name
        self.run: Any = None

    def open(self, ident: dict[str, Any]) -> tuple[dict[str, Any], int]:
        import wandb

        # console="off": W&B would otherwise wrap this process's stdout and stderr, the launcher's logs.
        self.run = wandb.init(project=self.project, id=ident["key"], resume="allow", name=self.run_name,
                              dir=str(self.run_dir), settings=wandb.Settings(console="off"))
        return {**ident, "project": self.project}, -1  # no mark a resumed offline run can read

    def describe(self, params: dict[str, str], tags: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)
        self.run.tags = tuple(sorted({*self.run.tags, *(f"{k}:{v}" for k, v in tags.items())}))
        self.run.summary.update(tags)

    def send(self, rows: list[tuple[int, Row]]) -> int:
        for step, row in rows:
            self.run.log({k: v for k, (v, _) in row.items()}, step=step)
        return rows[-1][0] if rows else -1

    def artifacts(self, files: list[Path], model: Path | None) -> None:
        import wandb

        for f in files:
            self.run.save(str(f), base_path=str(f.parent), policy="now")
        if model is not None:
            art = wandb.Artifact(f"{self.run.id}-model", type="model")
            art.add_dir(str(model))
            self.run.log_artifact(art)

    def close(self, status: str) -> None:
        if self.run is not None:
            if status == "KILLED":
                self.run.mark_preempting()
            self.run.finish(exit_code=0 if status == "FINISHED" else 1)
            self.run = None
