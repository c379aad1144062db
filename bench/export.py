"""`trainapp export` of a sharded (FSDP) snapshot: its wall time and its peak RSS against the model's
bytes (target: the peak RSS above a process that reads no weights <= 1.5x the model's bytes; the export is
built to hold about one copy of the model at a time, trainapp/tools/export.py).

A wide MLP (bench/export_task.py: 18 layers 2048 wide, 75.5 M parameters, 288 MiB in fp32; `--smoke`: 5
layers 1024 wide, 20 MiB) is trained 2 steps with AdamW by 2 torchrun workers, once sharded
(`parallel.strategy=fsdp`: torch.distributed.checkpoint shards, read by the export in one process a batch
of tensors at a time) and once whole (DDP: one `state.pt`, for comparison); each snapshot holds the model
and AdamW's two moments, 3x the model's bytes, of which the export must read only the model. Then, in
rounds, each in its own fresh process, in an order that rotates:

- a baseline per snapshot: a process that imports what the export imports, opens the snapshot as the
  export does (checksums, tensor names and shapes; for the sharded one torch.distributed.checkpoint's
  import, about 47 MiB), binds the run's task and builds its datasets, and reads no weights;
- `trainapp export RUN --out DIR` of each snapshot (sharded, whole) x dtype (fp32, `--dtype bf16`) x with
  and without the check (`--no-check`).

Each process reports its peak RSS (VmHWM of /proc/self/status at its end: this process's own memory
since its exec, not its parent's) and the largest anonymous and file-backed RSS a 10 ms sampler saw
(a mapped file's pages count in the RSS too). `ratio` = (export's peak - baseline's peak) / the model's
fp32 bytes, per round against that round's baseline of the same snapshot; medians over rounds.
`export_s` is the export's own time (its record's `seconds`), `process_s` the process's, imports
included (5-8 s of torch's import on a 2-core machine).

    python -m bench.export            # writes bench/results/export.json (3 rounds of 10 processes:
                                        6-11 min, 2 cores)
    python -m bench.export --smoke    # a 20 MiB model, one round of 5 processes, bench/results/smoke/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import REPO, result_path

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TASK = "bench.export_task:WideMLP"
FULL = {"width": 2048, "depth": 18}
SMOKE = {"width": 1024, "depth": 5}
VARIANTS = {  # name: (snapshot, export arguments)
    "sharded_fp32_nocheck": ("fsdp", ["--no-check"]),
    "sharded_fp32_check": ("fsdp", []),
    "sharded_bf16_nocheck": ("fsdp", ["--dtype", "bf16", "--no-check"]),
    "sharded_bf16_check": ("fsdp", ["--dtype", "bf16"]),
    "whole_fp32_nocheck": ("ddp", ["--no-check"]),
    "whole_fp32_check": ("ddp", []),
    "whole_bf16_nocheck": ("ddp", ["--dtype", "bf16", "--no-check"]),
    "whole_bf16_check": ("ddp", ["--dtype", "bf16"]),
}
SMOKE_VARIANTS = ("sharded_fp32_check", "sharded_bf16_nocheck", "whole_fp32_check")
HEADLINE = "sharded_fp32_check"  # what `trainapp export` does by default
TARGET = 1.5
MiB = 2**20


# --- the measured process -------------------------------------------------------------------------------

def _status() -> dict[str, int]:
    """The memory lines of /proc/self/status, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    """The largest anonymous and file-backed RSS seen every `period` s (VmHWM has only their sum)."""

    def __init__(self, period: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.period, self.anon, self.file, self.at_peak = period, 0, 0, {}
        self._stop_at = threading.Event()

    def run(self) -> None:
        while not self._stop_at.wait(self.period):
            self.take()

    def take(self) -> None:
        s = _status()
        self.anon, self.file = max(self.anon, s["RssAnon"]), max(self.file, s["RssFile"])
        if s["VmRSS"] > self.at_peak.get("VmRSS", 0):
            self.at_peak = s

    def stop(self) -> dict[str, int]:
        self._stop_at.set()
        self.join()
        self.take()
        return {"peak_rss": _status()["VmHWM"], "max_anon_rss": self.anon, "max_file_rss": self.file,
                "sampled_peak": {k: v for k, v in self.at_peak.items() if k != "VmHWM"}}


def baseline(run_dir: str) -> dict:
    """What a process that reads no weights holds: what the export imports, the snapshot opened (its
    checksums verified, its tensors' names, dtypes and shapes read: a sharded one imports
    torch.distributed.checkpoint for that, as the export does), the run's task bound and its datasets
    built. Also the model's bytes, from those names, dtypes and shapes."""
    import torch

    from trainapp.config import from_dict
    from trainapp.core.task import bind
    from trainapp.group import DistContext
    from trainapp.tasks.load import resolve
    from trainapp.tools import export  # noqa: F401  (what `trainapp export` imports)
    from trainapp.weights.sources import open_source

    source = open_source(run_dir)
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None,
                      owns_group=False)
    cfg = from_dict(source.config)
    bound = bind(resolve(cfg), ctx, name=cfg.task.name, seed=cfg.seed, run_dir=cfg.run.dir)
    train, val = bound.datasets()
    return {"model_bytes": sum(e.nbytes for e in source.entries.values()), "tensors": len(source.entries),
            "items": len(train) + len(val), "kind": source.kind}


def child(result_file: str, argv: list[str]) -> int:
    """One measured process: `baseline RUN` or trainapp's command line `export ...`; writes its result."""
    sampler = Sampler()
    sampler.start()
    if argv[0] == "baseline":
        out, code = baseline(argv[1]), 0
    else:
        from trainapp import cli

        code, out = cli.main(argv), {}
    import torch

    out.update(sampler.stop(), threads=torch.get_num_threads())
    Path(result_file).write_text(json.dumps(out))
    return code


# --- the benchmark --------------------------------------------------------------------------------------

def env() -> dict[str, str]:
    return dict(os.environ)  # bench.common put this checkout on PYTHONPATH


def train(strategy: str, size: dict, out: Path) -> float:
    """A run of 2 AdamW steps; its seconds. Its final snapshot is what the exports read."""
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "trainapp", "train", f"run.dir={out}",
           f"task.name={TASK}", f"task.args.width={size['width']}", f"task.args.depth={size['depth']}",
           f"parallel.strategy={strategy}", "optim.name=adamw", "train.max_steps=2",
           "train.epochs=1000", "train.batch_size=8", "train.eval_every=0", "snapshot.every_steps=0",
           "train.progress=false", "run.export=false"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env={**env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=1200)
    if r.returncode != 0:
        raise SystemExit(f"bench/export.py: the {strategy} run failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def measure(args: list[str], tmp: Path, name: str) -> dict:
    """One fresh process of `child(args)`: its result and its wall time."""
    result = tmp / f"{name}.json"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "bench.export", "--child", str(result), *args], cwd=REPO,
                       env=env(), capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - t0
    if r.returncode != 0 or not result.exists():
        raise SystemExit(f"bench/export.py: {name} failed (exit {r.returncode}):\n"
                         f"{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return {**json.loads(result.read_text()), "process_s": wall}


def export_once(name: str, runs: dict[str, Path], tmp: Path, i: int) -> dict:
    snapshot, extra = VARIANTS[name]
    out = tmp / f"out-{name}-{i}"
    got = measure(["export", str(runs[snapshot]), "--out", str(out), *extra], tmp, f"{name}-{i}")
    record = json.loads((out / "trainapp.json").read_text())
    check = record["check"]
    got.update(export_s=record["seconds"], file_bytes=record["bytes"], source_kind=record["source"]["kind"],
               check_passed=check["outputs"]["passed"] if isinstance(check["outputs"], dict) else None,
               check_equal=check["outputs"].get("equal") if isinstance(check["outputs"], dict) else None)
    shutil.rmtree(out)
    return got


def base_of(name: str) -> str:
    """The baseline an export is measured against: the one that opened the same kind of snapshot."""
    return f"baseline_{VARIANTS[name][0]}"


def summarise(rounds: list[dict], names: list[str]) -> dict:
    model = rounds[0]["baseline_fsdp"]["model_bytes"]
    out = {}
    for name in names:
        up = [r[name]["peak_rss"] - r[base_of(name)]["peak_rss"] for r in rounds]
        out[name] = {"ratio": statistics.median(u / model for u in up), "ratios": [u / model for u in up],
                     "peak_rss_mb": statistics.median(r[name]["peak_rss"] for r in rounds) / MiB,
                     "increase_mb": statistics.median(up) / MiB,
                     "max_anon_rss_mb": statistics.median(r[name]["max_anon_rss"] for r in rounds) / MiB,
                     "max_file_rss_mb": statistics.median(r[name]["max_file_rss"] for r in rounds) / MiB,
                     "export_s": statistics.median(r[name]["export_s"] for r in rounds),
                     "process_s": statistics.median(r[name]["process_s"] for r in rounds),
                     "checks_passed": [r[name]["check_passed"] for r in rounds],
                     "file_bytes": rounds[0][name]["file_bytes"]}
    for kind in ("fsdp", "ddp"):
        b = f"baseline_{kind}"
        out[b] = {"peak_rss_mb": statistics.median(r[b]["peak_rss"] for r in rounds) / MiB,
                  "max_anon_rss_mb": statistics.median(r[b]["max_anon_rss"] for r in rounds) / MiB,
                  "max_file_rss_mb": statistics.median(r[b]["max_file_rss"] for r in rounds) / MiB,
                  "process_s": statistics.median(r[b]["process_s"] for r in rounds)}
    return out


def one_round(i: int, names: list[str], runs: dict[str, Path], tmp: Path) -> dict:
    """Both baselines and every export, each process in another place of the order each round."""
    jobs = ["baseline_fsdp", "baseline_ddp", *names]
    jobs = jobs[i % len(jobs):] + jobs[:i % len(jobs)]
    got = {}
    for name in jobs:
        kind = name.removeprefix("baseline_")
        got[name] = (measure(["baseline", str(runs[kind])], tmp, f"{name}-{i}") if name.startswith("baseline")
                     else export_once(name, runs, tmp, i))
    print(f"round {i}: model {got['baseline_fsdp']['model_bytes'] / MiB:.1f} MiB, baselines "
          f"{got['baseline_fsdp']['peak_rss'] / MiB:.0f} / {got['baseline_ddp']['peak_rss'] / MiB:.0f} MiB "
          "(sharded / whole); " + "; ".join(
              f"{n} +{(got[n]['peak_rss'] - got[base_of(n)]['peak_rss']) / MiB:.0f} MiB "
              f"{got[n]['export_s']:.1f} s"
              for n in names), flush=True)
    return got


def main() -> int:
    if sys.argv[1:2] == ["--child"]:  # one measured process: --child RESULT_FILE ARGS...
        return child(sys.argv[2], sys.argv[3:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a 20 MiB model, one round of five processes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int,
                   help=f"the MLP's width (default {FULL['width']}; smoke {SMOKE['width']})")
    p.add_argument("--depth", type=int, help=f"its layers (default {FULL['depth']}; smoke {SMOKE['depth']})")
    p.add_argument("--out", help="result file (default bench/results/export.json)")
    args = p.parse_args()
    from bench.machine import describe
    from bench.scratch import scratch

    size = dict(SMOKE if args.smoke else FULL)
    size.update({k: v for k, v in (("width", args.width), ("depth", args.depth)) if v})
    names = list(SMOKE_VARIANTS if args.smoke else VARIANTS)
    if args.smoke:
        args.rounds = 1
    folder = result_path("", args.smoke)
    folder.mkdir(parents=True, exist_ok=True)
    with scratch("ta-bench-export-") as tmp_name:
        tmp = Path(tmp_name)
        runs = {s: tmp / f"run-{s}" for s in ("fsdp", "ddp")}
        train_s = {s: train(s, size, runs[s]) for s in runs}
        snapshot_bytes = {s: sum(f.stat().st_size for f in runs[s].joinpath("snapshots").rglob("*")
                                 if f.is_file())
                          for s in runs}
        rounds = [one_round(i, names, runs, tmp) for i in range(args.rounds)]
    model = rounds[0]["baseline_fsdp"]["model_bytes"]
    if rounds[0]["baseline_ddp"]["model_bytes"] != model:
        raise SystemExit(f"bench/export.py: the two snapshots hold other models ({model} bytes sharded, "
                         f"{rounds[0]['baseline_ddp']['model_bytes']} whole)")
    variants = summarise(rounds, names)
    sharded = [v["ratio"] for n, v in variants.items() if n.startswith("sharded")]
    result = {
        "sharded_peak_ratio": variants[HEADLINE]["ratio"], "sharded_peak_ratio_worst": max(sharded),
        "sharded_export_s": variants[HEADLINE]["export_s"],
        "whole_peak_ratio": variants["whole_fp32_check"]["ratio"],
        "whole_export_s": variants["whole_fp32_check"]["export_s"],
        "model_bytes": model, "model_mb": model / MiB, "tensors": rounds[0]["baseline_fsdp"]["tensors"],
        "variants": variants, "snapshot_bytes": snapshot_bytes, "train_s": train_s, "size": size,
        "optimizer": "adamw", "rounds": rounds, "smoke": args.smoke, "machine": describe(),
        "date": time.strftime("%Y-%m-%d"), "targets": {"sharded_peak_ratio": f"<= {TARGET}"},
    }
    out = Path(args.out) if args.out else folder / "export.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"model {model / MiB:.1f} MiB; " + "; ".join(
        f"{n}: ratio {v['ratio']:.2f} peak {v['peak_rss_mb']:.0f} MiB export {v['export_s']:.1f} s"
        for n, v in variants.items() if "ratio" in v))
    print(f"sharded_peak_ratio={result['sharded_peak_ratio']:.3f} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
