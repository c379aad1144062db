"""Snapshot cost: how long a snapshot holds training (sync vs async), and what one every N steps costs.

Two measurements, both with trainapp's own SnapshotManager writing real, fsynced, checksummed
snapshots of a real model's state (weights, SGD momentum, progress) to a directory on local disk:

1. Blocking time per snapshot, for resnet18- and resnet50-sized state on CPU: `save()` in sync mode
   (serialize + fsync + rename) and in async mode (the CPU copy only; the write is waited for between
   calls, outside the timing, so the number is the pure per-snapshot hold). Sync and async alternate.
   `async_vs_sync_blocking_ratio` is the worse (larger) of the two sizes' median ratios.
2. Throughput: rounds of N training steps (one process, forward + backward + SGD on CPU), each round
   either with no snapshot, or with one async (or sync) snapshot at its start; a round's time includes
   that `save()` and, at its end, waiting for the background write (which the next snapshot would wait
   for anyway). Modes rotate through every order. `throughput_loss_at_100_steps` = median(async
   round) / median(no-snapshot round) - 1, for resnet18 (the worse of the models measured).

    python bench/snapshot_cost.py            # writes bench/results/snapshot_cost.json
    python bench/snapshot_cost.py --smoke    # seconds; for CI, writes bench/results/smoke/
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ALONE = SimpleNamespace(is_main=True, distributed=False, rank=0)


def build(model_name: str, image_size: int, batch: int):
    import torch

    from trainapp.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name, 10).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, image_size, image_size).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))
    return model, opt, x, y


def step(model, opt, x, y) -> None:
    import torch.nn.functional as F

    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def state_of(model, opt, step_no: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "progress": {"global_step": step_no}}


def state_mb(state: dict) -> float:
    import torch

    total = 0
    for part in (state["model"], *[s for s in state["optimizer"]["state"].values()]):
        total += sum(t.numel() * t.element_size() for t in part.values() if isinstance(t, torch.Tensor))
    return total / 2**20


def blocking(model_name: str, reps: int, root: Path) -> dict:
    from trainapp.snapshot import SnapshotManager

    model, opt, x, y = build(model_name, 32, 2)
    step(model, opt, x, y)  # momentum buffers exist, as in training
    modes = {"sync": SnapshotManager(root / f"{model_name}-sync", 1, 2),
             "async": SnapshotManager(root / f"{model_name}-async", 1, 2, async_write=True)}
    times = {"sync": [], "async": []}
    for i in range(reps + 1):
        for mode in (("sync", "async") if i % 2 else ("async", "sync")):
            m = modes[mode]
            m.save(ALONE, i + 1, state_of(model, opt, i + 1), {"global_step": i + 1}, {})
            if i > 0:  # the first of each is a warm-up
                times[mode].append(m.last_blocking_s)
            m.wait()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"state_mb": round(state_mb(state_of(model, opt, 0)), 1), "sync_blocking_s_median": med["sync"],
            "async_blocking_s_median": med["async"], "async_vs_sync_blocking_ratio": med["async"] / med["sync"],
            "sync_blocking_s": times["sync"], "async_blocking_s": times["async"]}


def throughput(model_name: str, rounds: int, steps: int, batch: int, image_size: int, root: Path) -> dict:
    from trainapp.snapshot import SnapshotManager

    model, opt, x, y = build(model_name, image_size, batch)
    managers = {"async": SnapshotManager(root / f"{model_name}-tp-async", steps, 2, async_write=True),
                "sync": SnapshotManager(root / f"{model_name}-tp-sync", steps, 2)}
    orders = list(itertools.permutations(("none", "async", "sync")))
    times = {"none": [], "async": [], "sync": []}
    n = 0
    for r in range(rounds + 1):
        for mode in orders[r % len(orders)]:
            t0 = time.perf_counter()
            if mode != "none":
                managers[mode].save(ALONE, n, state_of(model, opt, n), {"global_step": n}, {})
            for _ in range(steps):
                step(model, opt, x, y)
                n += 1
            if mode != "none":
                managers[mode].wait()
            if r > 0:  # round 0 warms up every mode
                times[mode].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"steps_per_round": steps, "batch": batch, "image_size": image_size,
            "step_ms_no_snapshot": 1000 * med["none"] / steps,
            "throughput_loss_async": med["async"] / med["none"] - 1,
            "throughput_loss_sync": med["sync"] / med["none"] - 1,
            "round_s": {k: [round(t, 3) for t in v] for k, v in times.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny run that only checks the benchmark works")
    p.add_argument("--reps", type=int, default=7, help="timed snapshots per mode for the blocking time")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds per mode for the throughput")
    p.add_argument("--steps", type=int, default=100, help="training steps per round (one snapshot per round)")
    p.add_argument("--models", default="resnet18,resnet50", help="models whose state is snapshotted")
    p.add_argument("--throughput-models", default="resnet18", help="models trained for the throughput rounds")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    p.add_argument("--dir", help="where snapshots are written (default: a temporary directory)")
    p.add_argument("--out", help="result file (default bench/results/snapshot_cost.json)")
    args = p.parse_args()
    if args.smoke:
        args.reps, args.rounds, args.steps, args.batch = 1, 1, 3, 2
        args.models = args.throughput_models = "resnet18"
    out = Path(args.out or HERE / "results" / ("smoke" if args.smoke else "") / "snapshot_cost.json")
    import torch

    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="trainapp-snapcost-", dir=args.dir))
    try:
        block = {m: blocking(m, args.reps, root) for m in args.models.split(",")}
        for m, b in block.items():
            print(f"{m}: {b['state_mb']} MB state, blocking sync {b['sync_blocking_s_median'] * 1000:.0f} ms, "
                  f"async {b['async_blocking_s_median'] * 1000:.0f} ms", flush=True)
        tput = {m: throughput(m, args.rounds, args.steps, args.batch, args.image_size, root)
                for m in args.throughput_models.split(",")}
        for m, t in tput.items():
            print(f"{m}: {t['step_ms_no_snapshot']:.1f} ms/step; one snapshot per {args.steps} steps costs "
                  f"{100 * t['throughput_loss_async']:.2f}% async, {100 * t['throughput_loss_sync']:.2f}% sync",
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "async_vs_sync_blocking_ratio": max(b["async_vs_sync_blocking_ratio"] for b in block.values()),
        f"throughput_loss_at_{args.steps}_steps": max(t["throughput_loss_async"] for t in tput.values()),
        "blocking": block, "throughput": tput,
        "targets": {"async_vs_sync_blocking_ratio": "<= 0.25", "throughput_loss_at_100_steps": "<= 0.01"},
        "torch": torch.__version__, "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.system()}",
        "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    key = f"throughput_loss_at_{args.steps}_steps"
    print(f"async_vs_sync_blocking_ratio={result['async_vs_sync_blocking_ratio']:.3f} "
          f"{key}={result[key]:.4f} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
