"""Compile and activation checkpointing on char_lm: step time compiled against eager, the first step of a
resumed compiled run on an empty local cache with and without the carried compile cache beside an eager
resume, and activation checkpointing's memory and step time.

One process (`python -m trainapp train`, 2 threads) trains a 4-layer, 256-wide char_lm on 128-character
blocks, in rounds that alternate eager, compiled and checkpointed runs of the same steps (the first
compiled run with an empty inductor cache: the cold compile). Step times are the median of each run's
per-step `train` records after its first steps; `compile_step_ratio` is compiled over eager, per round,
then the median (`control_ratio`: eager over the other eager run of the round). Each resume starts from
a copy of a finished run at its last snapshot and trains 3 more steps, its own local inductor cache
empty (`TORCHINDUCTOR_CACHE_DIR`, as on a fresh node); its first-step time runs from its `start` record
to its first `train` record, its evaluation at the end (`*_eval_s`) from its last `train` record to the
`eval` record (a compiled model's evaluation graphs compiled, or found in the carried cache). Activation
memory is what a training forward keeps for the backward (the bytes of the tensors autograd saves, with
and without checkpointing, at 512-character blocks),
measured in this process: a CPU has no allocator peak to read.

    python -m bench.compile            # writes bench/results/compile.json
    python -m bench.compile --smoke    # a few steps, one round; writes bench/results/smoke/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, records, result_path
from bench.machine import describe
from bench.scratch import scratch

MODEL = ["task.name=char_lm", "task.args.n_layer=4", "task.args.n_embd=256", "task.args.n_head=4",
         "task.args.block_size=64", "train.batch_size=16", "train.progress=false", "train.log_every=1",
         "train.epochs=100", "amp.dtype=off"]
VARIANTS = {"eager": [], "compiled": ["parallel.compile=true"],
            "checkpointed": ["parallel.activation_checkpoint=full"]}


def train(run_dir: Path, local_cache: Path, steps: int, *extra: str) -> float:
    """One run to `steps` (a resume when `run_dir` has snapshots); its wall seconds."""
    cmd = [sys.executable, "-m", "trainapp", "train", f"run.dir={run_dir}", *MODEL,
           f"train.max_steps={steps}",
           f"snapshot.every_steps={steps}", *extra]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(local_cache), "OMP_NUM_THREADS": "2"}
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[3:])} failed:\n{r.stderr[-3000:]}")
    return time.monotonic() - t0


def attempt(run_dir: Path) -> tuple[dict, list[dict]]:
    """The last attempt's start record and its train records."""
    recs = records(run_dir)
    last = max(i for i, r in enumerate(recs) if r["kind"] == "start")
    return recs[last], [r for r in recs[last:] if r["kind"] == "train"]


def step_ms(run_dir: Path, skip: int) -> float:
    """The median step time of the run's last attempt, its first `skip` steps left out."""
    start, trains = attempt(run_dir)
    return statistics.median(start["global_batch"] / r["samples_per_s"] * 1000 for r in trains[skip:])


def first_step_s(run_dir: Path) -> float:
    start, trains = attempt(run_dir)
    return trains[0]["time"] - start["time"]


def eval_s(run_dir: Path) -> float:
    """The last attempt's final evaluation: from its last step's record to the evaluation's."""
    recs = records(run_dir)
    last_eval = max(i for i, r in enumerate(recs) if r["kind"] == "eval")
    last_train = max(i for i, r in enumerate(recs[:last_eval]) if r["kind"] == "train")
    return recs[last_eval]["time"] - recs[last_train]["time"]


def activation_bytes(checkpointed: bool, block: int = 512) -> int:
    import torch

    from trainapp.core.parallel import checkpointing
    from trainapp.tasks.char_lm import CharTransformer

    torch.manual_seed(0)
    model = CharTransformer(80, block, 4, 4, 256, dropout=0.0)
    if checkpointed:
        checkpointing.checkpoint(list(model.blocks))
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    x = torch.randint(0, 80, (8, block))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).float().square().mean()
    loss.backward()
    return total


def resumes(tmp: Path, runs: dict[str, Path], steps: int) -> dict[str, float]:
    """First-step seconds of three resumes on an empty local cache: compiled with the carried cache
    (warm), compiled without it (cold), eager."""
    out = {}
    compiled = VARIANTS["compiled"]
    for name, source, drop_cache, extra in (("compile_resume_warm_s", runs["compiled"], False, compiled),
                                            ("compile_resume_cold_s", runs["compiled"], True, compiled),
                                            ("eager_resume_s", runs["eager"], False, [])):
        run = tmp / name
        shutil.copytree(source, run)
        if drop_cache:
            shutil.rmtree(run / "compile")
        train(run, tmp / f"local-{name}", steps + 3, *extra)
        out[name] = round(first_step_s(run), 2)
        out[name.replace("_s", "_eval_s")] = round(eval_s(run), 2)
        print(f"  {name}: first step {out[name]} s after the start, its evaluation "
              f"{out[name.replace('_s', '_eval_s')]} s", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one short round: only checks that it works")
    p.add_argument("--out", help="result file (default bench/results/compile.json)")
    args = p.parse_args()
    out = result_path("compile.json", args.smoke, args.out)
    steps, rounds, skip = (6, 1, 2) if args.smoke else (40, 3, 5)
    per_round: list[dict[str, float]] = []
    with scratch("ta-bench-compile-") as t:
        tmp = Path(t)
        first: dict[str, Path] = {}
        cold_first_step = None
        for i in range(rounds):
            row = {}
            order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
            for name in order + ["eager-control"]:
                run = tmp / f"{name}-{i}"
                wall = train(run, tmp / "local-shared", steps, *VARIANTS.get(name, []))
                row[name] = step_ms(run, skip)
                first.setdefault(name, run)
                print(f"round {i + 1}/{rounds} {name}: {row[name]:.1f} ms/step, {wall:.0f} s", flush=True)
                if name == "compiled" and cold_first_step is None:
                    cold_first_step = first_step_s(run)  # the first compiled run: an empty local cache
            per_round.append(row)
        eager_loss = [r["loss"] for r in attempt(first["eager"])[1]]
        compiled_loss = [r["loss"] for r in attempt(first["compiled"])[1]]
        losses = max(abs(a - b) / abs(a) for a, b in zip(eager_loss, compiled_loss))
        resumed = resumes(tmp, first, steps)
    full, kept = activation_bytes(False), activation_bytes(True)
    med = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    result = {
        "compile_step_ratio": statistics.median(r["compiled"] / r["eager"] for r in per_round),
        "control_ratio": statistics.median(r["eager"] / r["eager-control"] for r in per_round),
        "eager_step_ms": med["eager"], "compiled_step_ms": med["compiled"],
        "compile_first_step_cold_s": round(cold_first_step or 0.0, 2), **resumed,
        "compile_warm_minus_eager_resume_s": round(resumed["compile_resume_warm_s"]
                                                   - resumed["eager_resume_s"], 2),
        "compile_loss_rel_diff_max": losses,
        "ac_activation_ratio": kept / full, "ac_activation_bytes": {"none": full, "full": kept},
        "ac_step_ratio": statistics.median(r["checkpointed"] / r["eager"] for r in per_round),
        "rounds": per_round, "steps": steps, "model": " ".join(MODEL[:5]), "machine": describe(),
        "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke,
        "target": "warm compiled resume within 5 s of the eager one; activation ratio <= 0.6",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"compile: step {result['compile_step_ratio']:.3f}x eager (control {result['control_ratio']:.3f}); "
          f"resume first step warm {resumed['compile_resume_warm_s']} s, cold "
          f"{resumed['compile_resume_cold_s']} s, eager {resumed['eager_resume_s']} s; activations with "
          f"checkpointing "
          f"{result['ac_activation_ratio']:.2f}x at {result['ac_step_ratio']:.2f}x the step time -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
