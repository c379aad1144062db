"""Snapshot cost: how long a snapshot holds training (sync vs async), and what one every N steps costs.

Two measurements, both with trainapp's own SnapshotManager writing real, fsynced, checksummed
snapshots of a real model's state (weights, SGD momentum, progress) to a directory on local disk:

1. Blocking time per snapshot, for resnet18- and resnet50-sized state on CPU: `save()` in sync mode
   (serialize + fsync + rename) and in async mode (the CPU copy only; the write is waited for between
   calls, outside the timing, so the number is the pure per-snapshot hold). Sync and async alternate.
   `async_vs_sync_blocking_ratio` is the worse (larger) of the two sizes' median ratios.
2. Throughput: resnet18 training on CPU (one process, forward + backward + SGD) with a snapshot every
   N steps, each step timed. A snapshot's cost is the time `save()` held training plus how much
   longer the following `--window` steps took than the interval's other steps on average (the
   background write competes for the cores there); divided by the N steps' time, that is the throughput lost
   to one snapshot per N steps (`throughput_loss_at_100_steps`: median over intervals, async). A control
   window mid-interval, where nothing happens, is measured the same way: the noise floor. (Whole
   rounds with and without snapshots were tried first: on a small shared machine their drift, several
   percent, is larger than the effect.) Measured twice: training on every core (the writer's CPU work
   then comes straight out of training's), and with one core left free, as on a GPU node.

    python -m bench.snapshot_cost            # writes bench/results/snapshot_cost.json
    python -m bench.snapshot_cost --smoke    # seconds; for CI, writes bench/results/smoke/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench.common import result_path
from bench.machine import describe
# one process
ALONE = SimpleNamespace(is_main=True, distributed=False, rank=0, broadcast_object=lambda obj: obj)
ALONE.files = ALONE


def build(model_name: str, image_size: int, batch: int):
    import torch

    from trainapp.tasks.image import build_model

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


def manager(root: Path, every_steps: int, async_write: bool = False):
    """trainapp's snapshot manager over `root`, keeping 2, as a run alone would make it."""
    from trainapp.snapshots.manager import SnapshotManager
    from trainapp.snapshots.publish import LocalPublish

    return SnapshotManager(LocalPublish(root, keep=2), every_steps, async_write=async_write)


def blocking(model_name: str, reps: int, root: Path) -> dict:
    model, opt, x, y = build(model_name, 32, 2)
    step(model, opt, x, y)  # momentum buffers exist, as in training
    modes = {"sync": manager(root / f"{model_name}-sync", 1),
             "async": manager(root / f"{model_name}-async", 1, True)}
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
            "async_blocking_s_median": med["async"],
            "async_vs_sync_blocking_ratio": med["async"] / med["sync"],
            "sync_blocking_s": times["sync"], "async_blocking_s": times["async"]}


def throughput(model_name: str, intervals: int, steps: int, window: int, batch: int, image_size: int,
               root: Path) -> dict:
    """Per-step times around each snapshot, against the quiet rest of the same interval.

    Round-to-round drift on a small shared machine (several percent) is larger than the effect, so
    the cost is measured where it happens: for a snapshot at the start of an interval of `steps`
    steps, the excess is the time `save()` held training plus, over the next `window` steps, how much
    longer they took than the mean step of that interval outside the window (the background write
    and the copy's cache effects land there). A control window in the middle of each interval, where
    nothing happens, gives the noise floor the same way.
    """
    model, opt, x, y = build(model_name, image_size, batch)
    out = {}
    for mode in ("async", "sync"):
        m = manager(root / f"{model_name}-tp-{mode}", steps, mode == "async")
        losses, controls, n, step_s = [], [], 0, []
        for k in range(intervals + 1):
            held = 0.0
            times = []
            for i in range(steps):
                if i == 0:
                    m.save(ALONE, n, state_of(model, opt, n), {"global_step": n}, {})
                    held = m.last_blocking_s
                t0 = time.perf_counter()
                step(model, opt, x, y)
                times.append(time.perf_counter() - t0)
                n += 1
            if k == 0:
                continue  # warm-up interval
            mid = steps // 2
            rest = times[window:mid] + times[mid + window:]
            # The mean, not the median: step times are skewed to the right, so a window of ordinary
            # steps sums to more than `window` median steps; against the median the control window
            # itself came out at +0.9%, a bias charged to every snapshot.
            base = statistics.fmean(rest)
            losses.append((held + sum(t - base for t in times[:window])) / (steps * base))
            controls.append(sum(t - base for t in times[mid:mid + window]) / (steps * base))
            step_s.append(statistics.median(rest))
        m.wait()
        out[mode] = {"throughput_loss": statistics.median(losses), "control": statistics.median(controls),
                     "per_snapshot": [round(v, 5) for v in losses],
                     "step_ms": 1000 * statistics.median(step_s)}
    return {"steps_per_snapshot": steps, "window": window, "batch": batch, "image_size": image_size,
            "intervals": intervals, "step_ms_no_snapshot": out["async"]["step_ms"],
            "throughput_loss_async": out["async"]["throughput_loss"],
            "throughput_loss_sync": out["sync"]["throughput_loss"],
            "control_async": out["async"]["control"], "control_sync": out["sync"]["control"], "modes": out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny run that only checks the benchmark works")
    p.add_argument("--reps", type=int, default=7, help="timed snapshots per mode for the blocking time")
    p.add_argument("--intervals", type=int, default=12,
                   help="snapshot intervals timed per mode for the throughput")
    p.add_argument("--steps", type=int, default=100, help="training steps per snapshot interval")
    p.add_argument("--window", type=int, default=30, help="steps after a snapshot that are charged to it")
    p.add_argument("--models", default="resnet18,resnet50", help="models whose state is snapshotted")
    p.add_argument("--throughput-models", default="resnet18", help="models trained for the throughput rounds")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    p.add_argument("--dir", help="where snapshots are written (default: a temporary directory)")
    p.add_argument("--out", help="result file (default bench/results/snapshot_cost.json)")
    args = p.parse_args()
    if args.smoke:
        args.reps, args.intervals, args.steps, args.window, args.batch = 1, 1, 8, 2, 2
        args.models = args.throughput_models = "resnet18"
    out = result_path("snapshot_cost.json", args.smoke, args.out)
    import torch

    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="trainapp-snapcost-", dir=args.dir))
    try:
        block = {m: blocking(m, args.reps, root) for m in args.models.split(",")}
        for m, b in block.items():
            print(f"{m}: {b['state_mb']} MB state, blocking sync {b['sync_blocking_s_median'] * 1000:.0f} "
                  f"ms, async {b['async_blocking_s_median'] * 1000:.0f} ms", flush=True)
        tput = {m: throughput(m, args.intervals, args.steps, args.window, args.batch, args.image_size, root)
                for m in args.throughput_models.split(",")}
        # The same with one core left to the writer, as on a GPU node whose CPU is not saturated.
        spare = {}
        if args.threads > 1:
            torch.set_num_threads(args.threads - 1)
            spare = {m: throughput(m, args.intervals, args.steps, args.window, args.batch,
                                   args.image_size, root)
                     for m in args.throughput_models.split(",")}
            torch.set_num_threads(args.threads)
        for m, t in [*tput.items(), *[(f"{k} ({args.threads - 1} thread(s), a spare core)", v)
                                      for k, v in spare.items()]]:
            print(f"{m}: {t['step_ms_no_snapshot']:.1f} ms/step; one snapshot per {args.steps} steps costs "
                  f"{100 * t['throughput_loss_async']:.2f}% async, "
                  f"{100 * t['throughput_loss_sync']:.2f}% sync (control windows: "
                  f"{100 * t['control_async']:.2f}%, {100 * t['control_sync']:.2f}%)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "async_vs_sync_blocking_ratio": max(b["async_vs_sync_blocking_ratio"] for b in block.values()),
        f"throughput_loss_at_{args.steps}_steps": max(t["throughput_loss_async"] for t in tput.values()),
        f"throughput_loss_at_{args.steps}_steps_spare_core": (
            max(t["throughput_loss_async"] for t in spare.values()) if spare else None),
        "blocking": block, "throughput": tput, "throughput_spare_core": spare,
        "targets": {"async_vs_sync_blocking_ratio": "<= 0.25", "throughput_loss_at_100_steps": "<= 0.01"},
        "torch": torch.__version__, "threads": args.threads,
        "machine": describe(),
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
