"""trainapp against PyTorch Lightning, side by side: the same model on the same data, the same global
batch, precision and optimizer, under Lightning's Trainer (DDP) and under trainapp, eager and compiled.

Every contestant is 2 processes under `torchrun --standalone` (one thread each, Gloo), training char_lm's
4-layer, 128-wide transformer on the task's built-in text in 64-character windows, 16 per rank (global
batch 32), AdamW, gradient clipping at 1.0, fp32 (what `amp.dtype=auto` gives on a CPU without native
bf16; bf16 autocast where the CPU has it, in both). Lightning finds torchrun's environment and does not
spawn processes of its own; its DistributedSampler and trainapp's deal the same windows. A round runs
trainapp eager, Lightning, trainapp compiled (`parallel.compile=true`, its inductor cache warm after the
first round) and trainapp eager again (the control), in an order that rotates from round to round. Per
run: the median over its intervals of 10 steps, the first left out, of the step time (trainapp: its
`train` records at `train.log_every=10`, global batch / samples_per_s; Lightning: a callback's clock at
every batch end, averaged over the same intervals) and of rank 0's process CPU time per step (trainapp's
`ranks` records' `cpu_ms`; Lightning's `time.process_time()`). A record per step would make trainapp do
a log interval's work (a collective and a file write) at every step, which Lightning's never do.
Ratios are taken within a round, then the median over rounds. Lightning is a dependency of this
benchmark only.

    python -m bench.lightning            # writes bench/results/lightning.json
    python -m bench.lightning --smoke    # one short round; writes bench/results/smoke/
    python -m bench.lightning --child OUT STEPS   # one Lightning process (run by torchrun)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import BIN, REPO, records, result_path
from bench.machine import describe
from bench.scratch import scratch

SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "dropout": 0.0}
PER_RANK, LR, CLIP, EVERY = 16, 0.005, 1.0, 10
TRAINAPP = ["task.name=char_lm", *(f"task.args.{k}={v}" for k, v in SHAPE.items()),
            f"train.batch_size={PER_RANK}", "train.progress=false", f"train.log_every={EVERY}",
            "train.epochs=100",
            "optim.name=adamw", f"optim.lr={LR}", "optim.lr_scaling=none", f"train.grad_clip={CLIP}",
            "snapshot.every_steps=0"]


def torchrun(*args: str) -> list[str]:
    return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", *args]


def run(cmd: list[str], env: dict[str, str]) -> None:
    r = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")


def trainapp(run_dir: Path, steps: int, compiled: bool, env: dict[str, str]) -> tuple[float, float]:
    """(median step ms, median CPU ms per step) of rank 0."""
    run(torchrun("-m", "trainapp", "train", f"run.dir={run_dir}", *TRAINAPP, f"train.max_steps={steps}",
                 f"parallel.compile={str(compiled).lower()}"), env)
    recs = records(run_dir)
    batch = next(r for r in recs if r["kind"] == "start")["global_batch"]
    step = [batch / r["samples_per_s"] * 1000 for r in recs if r["kind"] == "train"][1:]
    cpu = [r["ranks"][0]["cpu_ms"] for r in recs if r["kind"] == "ranks"][1:]
    return statistics.median(step), statistics.median(cpu)


def lightning(out: Path, steps: int, env: dict[str, str]) -> tuple[float, float]:
    run(torchrun("-m", "bench.lightning", "--child", str(out), str(steps)), env)
    got = json.loads(out.read_text())

    def intervals(ms: list[float]) -> list[float]:  # per-step means over trainapp's log intervals
        return [statistics.fmean(ms[i:i + EVERY]) for i in range(0, len(ms) - EVERY + 1, EVERY)][1:]

    return statistics.median(intervals(got["step_ms"])), statistics.median(intervals(got["cpu_ms"]))


def child(out: str, steps: int) -> int:
    """One Lightning rank: the same model, data, batch and optimizer as trainapp's runs."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    from trainapp.core.amp import cpu_has_native_bf16
    from trainapp.tasks.char_lm import CharLM

    task = CharLM(**SHAPE)
    train_ds, _ = task.datasets(None)
    bf16 = cpu_has_native_bf16()

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = task.model(None)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.step_ms: list[float] = []
            self.cpu_ms: list[float] = []
            self.last = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, *args: object) -> None:
            now = (time.perf_counter(), time.process_time())
            self.step_ms.append((now[0] - self.last[0]) * 1000)
            self.cpu_ms.append((now[1] - self.last[1]) * 1000)
            self.last = now

    torch.manual_seed(0)
    clock = Clock()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, gradient_clip_val=CLIP, callbacks=[clock],
                        precision="bf16-mixed" if bf16 else "32-true")
    loader = torch.utils.data.DataLoader(train_ds, batch_size=PER_RANK, shuffle=True, drop_last=True)
    trainer.fit(Module(), loader)
    if trainer.global_rank == 0:
        Path(out).write_text(json.dumps({"step_ms": clock.step_ms, "cpu_ms": clock.cpu_ms,
                                         "precision": trainer.precision, "lightning": L.__version__}))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one short round: only checks that it works")
    p.add_argument("--out", help="result file (default bench/results/lightning.json)")
    p.add_argument("--child", nargs=2, metavar=("OUT", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]))
    out = result_path("lightning.json", args.smoke, args.out)
    steps, rounds = (30, 1) if args.smoke else (80, 5)
    names = ["trainapp", "lightning", "compiled", "control"]
    per_round: list[dict[str, tuple[float, float]]] = []
    with scratch("ta-bench-lightning-") as t:
        tmp = Path(t)
        env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor")}  # the compiled runs' cache, warm after one
        for i in range(rounds):
            row = {}
            for name in names[i % len(names):] + names[:i % len(names)]:
                where = tmp / f"{name}-{i}"
                row[name] = (lightning(where.with_suffix(".json"), steps, env) if name == "lightning"
                             else trainapp(where, steps, name == "compiled", env))
                print(f"round {i + 1}/{rounds} {name}: {row[name][0]:.1f} ms/step, {row[name][1]:.1f} CPU "
                      "ms/step", flush=True)
            per_round.append(row)

    def ratio(a: str, b: str, k: int) -> float:
        return statistics.median(r[a][k] / r[b][k] for r in per_round)

    result = {
        "trainapp_vs_lightning_step_ratio": ratio("trainapp", "lightning", 0),
        "compiled_vs_lightning_step_ratio": ratio("compiled", "lightning", 0),
        "compiled_vs_eager_step_ratio": ratio("compiled", "trainapp", 0),
        "control_ratio": ratio("trainapp", "control", 0),
        "trainapp_vs_lightning_cpu_ratio": ratio("trainapp", "lightning", 1),
        "compiled_vs_lightning_cpu_ratio": ratio("compiled", "lightning", 1),
        "cpu_control_ratio": ratio("trainapp", "control", 1),
        **{f"{n}_step_ms": statistics.median(r[n][0] for r in per_round) for n in names},
        **{f"{n}_cpu_ms": statistics.median(r[n][1] for r in per_round) for n in names},
        "rounds": per_round, "steps": steps, "global_batch": 2 * PER_RANK, "model": SHAPE,
        "machine": describe(), "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke,
        "target": "trainapp eager <= Lightning; compiled ahead of both where compile helps",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"lightning: trainapp {result['trainapp_vs_lightning_step_ratio']:.3f}x Lightning's step time "
          f"(compiled {result['compiled_vs_lightning_step_ratio']:.3f}x, control "
          f"{result['control_ratio']:.3f}), CPU {result['trainapp_vs_lightning_cpu_ratio']:.3f}x -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
