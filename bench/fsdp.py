"""FSDP against DDP (docs/fsdp.md): what each rank holds, and the step time, for the built-in character
transformer (`task.name=char_lm`, AdamW) trained by 2 torchrun workers on CPU (gloo), in alternating
rounds of one run per strategy.

- memory: the bytes of each rank's parameters, gradients (one per parameter, as every backward makes
  them) and AdamW state, from the run's `end` record (`state_bytes`, trainapp/core/parallel/checks.py); the
  ratio FSDP / DDP of the larger rank's total (target <= 0.55: a half, plus what is not sharded);
- step time: the median over a run's log intervals of global batch / samples per second (snapshots and
  evaluation left out), the ratio FSDP / DDP per round, then the median over rounds: for information (on
  CPU each FSDP unit's all-gather and reduce-scatter cost more than DDP's one bucketed all-reduce).

    python -m bench.fsdp             # writes bench/results/fsdp.json
    python -m bench.fsdp --smoke     # one short round, bench/results/smoke/
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

from bench.common import REPO, result_path
from bench.machine import describe
from bench.scratch import scratch

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def run(strategy: str, steps: int, out: Path) -> dict:
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "trainapp", "train", f"run.dir={out}",
           "task.name=char_lm", "optim.name=adamw", f"parallel.strategy={strategy}",
           f"train.max_steps={steps}", "train.epochs=1000", "train.log_every=5", "train.eval_every=0",
           "snapshot.every_steps=0", "train.progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"bench/fsdp.py: the {strategy} run failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["kind"] == "start")
    end = next(r for r in records if r["kind"] == "end")
    train = [r for r in records if r["kind"] == "train"][1:]  # the first interval holds the warm-up
    step_s = statistics.median(start["global_batch"] / r["samples_per_s"] for r in train)
    return {"state_bytes": end["state_bytes"], "step_s": step_s, "final_loss": end["final_loss"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one short round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", help="result file (default bench/results/fsdp.json)")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 15
    folder = result_path("", args.smoke)
    folder.mkdir(parents=True, exist_ok=True)
    rounds = []
    with scratch("ta-bench-fsdp-") as tmp:
        for i in range(args.rounds):
            order = ("ddp", "fsdp") if i % 2 == 0 else ("fsdp", "ddp")
            got = {s: run(s, args.steps, Path(tmp) / f"{s}-{i}") for s in order}
            rounds.append(got)
            print(f"round {i}: " + " ".join(f"{s} {got[s]['step_s'] * 1000:.0f} ms/step" for s in order),
                  flush=True)
    total = {s: max(b["total"] for b in rounds[0][s]["state_bytes"]) for s in ("ddp", "fsdp")}
    result = {
        "memory_ratio": total["fsdp"] / total["ddp"],
        "bytes_per_rank": {s: rounds[0][s]["state_bytes"] for s in ("ddp", "fsdp")},
        "step_time_ratio": statistics.median(r["fsdp"]["step_s"] / r["ddp"]["step_s"] for r in rounds),
        "step_ms": {s: statistics.median(r[s]["step_s"] * 1000 for r in rounds) for s in ("ddp", "fsdp")},
        "rounds": rounds, "steps": args.steps, "smoke": args.smoke, "machine": describe(),
        "date": time.strftime("%Y-%m-%d"), "targets": {"memory_ratio": "<= 0.55"},
    }
    out = Path(args.out) if args.out else folder / "fsdp.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"memory_ratio={result['memory_ratio']:.3f} step_time_ratio={result['step_time_ratio']:.3f} "
          f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
