"""A user's task whose items carry their index, and whose loss writes down what each rank trained on at
each step (tests/test_elastic.py, bench/resize.py): the sample ledger. Its model has dropout and
BatchNorm, the two things a resize changes when micro-batches or their randomness follow the rank.

Ledger lines go to RUN_DIR/ledger/<attempt>-rank<r>.jsonl: {"step", "rank", "world_size", "attempt",
"indices", "draw"}, where `step` is the optimizer step being trained (1-based) and `draw` a number drawn
from torch's generator after the forward pass: it depends on where the generator was when the
micro-batch started and on what its dropout drew.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn


class Ledger:
    def __init__(self, rows: int = 512, step_s: float = 0.0, record: bool = True, hidden: int = 32,
                 depth: int = 0):
        self.rows, self.step_s, self.record, self.hidden, self.depth = rows, step_s, record, hidden, depth
        self.attempt = f"{time.time_ns()}-{os.getpid()}"
        self.ctx = None

    def datasets(self, ctx):
        self.ctx = ctx
        if torch.distributed.is_initialized():  # one name for the attempt: rank 0's
            name = [self.attempt]
            torch.distributed.broadcast_object_list(name, src=0)
            self.attempt = name[0]
        g = torch.Generator().manual_seed(ctx.seed)
        x = torch.randn(self.rows, 8, generator=g)
        y = (x[:, :4].sum(1) > 0).long()
        train = [(x[i], y[i], i) for i in range(self.rows)]
        return train, train[:64]

    def model(self, ctx):
        h = self.hidden  # `depth` more h x h layers: compute per item for bench/stream.py
        deeper = [m for _ in range(self.depth) for m in (nn.Linear(h, h), nn.ReLU())]
        return nn.Sequential(nn.Linear(8, h), nn.BatchNorm1d(h), nn.ReLU(), *deeper, nn.Dropout(0.2),
                             nn.Linear(h, 2))

    def loss(self, model, batch):
        x, y, index = batch
        out = model(x)
        if self.record:
            ctx = self.ctx
            folder = Path(ctx.run_dir) / "ledger"
            folder.mkdir(parents=True, exist_ok=True)
            line = {"step": ctx.steps_done() + 1, "rank": ctx.rank, "world_size": ctx.world_size,
                    "attempt": self.attempt, "indices": index.tolist(), "draw": torch.rand(()).item()}
            with open(folder / f"{self.attempt}-rank{ctx.rank}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        if self.step_s:
            time.sleep(self.step_s)
        return nn.functional.cross_entropy(out.float(), y)

    def evaluate(self, model, batch):
        x, y, _ = batch
        out = model(x).float()
        return {"loss": nn.functional.cross_entropy(out, y, reduction="sum"),
                "correct": (out.argmax(1) == y).sum(), "count": len(y)}


def read(run_dir: str | Path) -> list[dict]:
    """Every ledger line of a run, in no particular order."""
    lines = []
    for path in sorted((Path(run_dir) / "ledger").glob("*.jsonl")):
        lines += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return lines


def check(run_dir: str | Path, rows: int, global_batch: int, seed: int = 0) -> dict:
    """What the final model was trained on, from the ledger: for each step the micro-batches of the last
    attempt that trained it (an attempt that crashed may have trained steps its successor redid).
    Returns counts: steps, redone steps, and per epoch the duplicates and the missing samples (of the
    epoch's whole global batches), and the world sizes seen."""
    by_step: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for line in read(run_dir):
        by_step[line["step"]][line["attempt"]].append(line)
    per_epoch = rows // global_batch
    epochs: dict[int, list[int]] = defaultdict(list)
    bad_steps = []
    for step, attempts in sorted(by_step.items()):
        last = max(attempts, key=lambda a: int(a.split("-")[0]))
        samples = [i for line in attempts[last] for i in line["indices"]]
        if len(samples) != global_batch:
            bad_steps.append((step, len(samples)))
        epochs[(step - 1) // per_epoch].extend(samples)
    report = {"steps": len(by_step), "redone": sum(len(a) > 1 for a in by_step.values()),
              "bad_steps": bad_steps,
              "world_sizes": sorted({line["world_size"] for a in by_step.values() for ls in a.values()
                                     for line in ls}),
              "epochs": {}}
    for epoch, samples in sorted(epochs.items()):
        # The epoch's order is the sampler's permutation (seed + epoch); its whole global batches are trained.
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        steps = len(samples) // global_batch
        expected = set(order[:steps * global_batch])
        report["epochs"][epoch] = {"samples": len(samples), "duplicates": len(samples) - len(set(samples)),
                                   "missing": len(expected - set(samples)),
                                   "foreign": len(set(samples) - expected)}
    return report
