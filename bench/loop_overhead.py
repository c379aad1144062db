"""Loop overhead: trainapp's training loop against a minimal hand-written DDP + autocast loop.

Both train the same model (trainapp's SmallCNN) on the same in-memory synthetic images with the same
per-worker batch, autocast (bf16 where the CPU runs it natively, else fp32: `--amp`), SGD and 2 gloo
workers on CPU, in one process group. Each round is
timed end to end: N optimizer steps, one evaluation over the validation set and one rank-0 save,
which both loops do (the minimal loop the way the seed articles do it).

On a 2-core machine two single-threaded workers share the cores with gloo's threads, and round times
drift by several percent, also with the position of a round in the sequence. So five contestants
run in balanced orders (every position and every neighbour equally often): trainapp, the minimal loop,
the minimal loop again as a control, trainapp without its preemption vote, and trainapp without its
per-rank phase timings (`observe.ranks=false`). Each round's ratio is trainapp against the mean of that
round's two minimal runs, and `loop_overhead_ratio` is the median over rounds (pairing within a round
cancels the drift between rounds; the ratio of the pooled medians is reported too); `control_ratio` (minimal
vs itself, per round, then the median) shows the noise floor of the same run; `vote_cost_ratio`
(trainapp vs trainapp without the vote) is what the preemption vote costs, and `vote_cpu_ratio` the
same in CPU time per step (all threads of rank 0's process; not stretched by waiting on the other
rank, so it resolves smaller costs; `cpu_control_ratio` is its noise floor); `ranks_cost_ratio` and
`ranks_cpu_ratio` are the same for the per-rank timings.

    python -m bench.loop_overhead            # writes bench/results/loop_overhead.json
    python -m bench.loop_overhead --smoke    # seconds; for CI, writes bench/results/smoke/
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

from bench.common import result_path
from bench.machine import describe
from bench.scratch import scratch



def minimal_round(ctx, steps: int, batch: int, train_ds, val_ds, out_dir: Path, seed: int, amp: str) -> float:
    """The seed articles' loop: DistributedSampler, DDP, autocast, GradScaler, rank-0 torch.save."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from trainapp.tasks.image import SmallCNN

    torch.manual_seed(seed)
    model = DDP(SmallCNN(10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # bf16 needs no loss scaling
    autocast = dict(device_type="cpu", dtype=torch.bfloat16, enabled=amp == "bf16")
    sampler = DistributedSampler(train_ds, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=batch, sampler=sampler, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=batch, sampler=DistributedSampler(val_ds, shuffle=False))
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            with torch.autocast(**autocast):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            done += 1
            if done == steps:
                break
        epoch += 1
    model.eval()
    correct = torch.zeros(2)
    with torch.no_grad():
        for x, y in val_loader:
            with torch.autocast(**autocast):
                correct += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
    dist.all_reduce(correct)
    if ctx.rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()},
                   out_dir / "minimal.pt")
    dist.barrier()
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def trainapp_round(ctx, steps: int, batch: int, out_dir: Path, seed: int, train_size: int, val_size: int,
                   amp: str, vote: bool = True, ranks: bool = True) -> float:
    import torch.distributed as dist

    from trainapp import config
    from trainapp.faults.guard import RankGuard
    from trainapp.launch import rank
    from trainapp.launch.torchrun import Torchrun

    cfg = config.load(None, [
        f"run.dir={out_dir}", f"seed={seed}", f"train.max_steps={steps}", f"train.batch_size={batch}",
        f"data.train_size={train_size}", f"data.val_size={val_size}",
        f"amp.dtype={'off' if amp == 'fp32' else amp}",
        # Features the minimal loop lacks are switched off, and so is channels_last (it changes the
        # compute, not the loop); logging, progress bar and the end-of-run snapshot stay on, because
        # they are the loop's overhead.
        "train.grad_clip=0", "snapshot.every_steps=0", "train.epochs=1000", "model.channels_last=false",
        f"observe.ranks={str(ranks).lower()}",
    ])
    trainer = rank.trainer(Torchrun(), cfg, ctx, RankGuard())  # the launcher's parts, on this process's group
    if not vote:  # the same loop without the preemption vote: what the vote itself costs
        trainer.boundary.vote.stop = lambda step: 0
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.train()
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def worker(args) -> None:
    import torch

    from trainapp.core.amp import resolve_dtype
    from trainapp.config import DistSection
    from trainapp.launch import dist as tdist
    from trainapp.observe import logs
    from trainapp.tasks.image import SyntheticImages

    ctx = tdist.setup(DistSection(timeout_s=300))
    logs.setup(ctx.rank, ctx.world_size)
    import logging
    logging.getLogger("trainapp").setLevel(logging.WARNING)  # keep the bench output readable
    train_ds = SyntheticImages(args.train_size, 10, 32, 0, "train")
    val_ds = SyntheticImages(args.val_size, 10, 32, 0, "val")
    # As amp.dtype=auto: emulated bf16 (no AVX-512/AMX) is ~9x slower than fp32 and would time the
    # emulation, not the loop.
    amp = "bf16" if resolve_dtype(args.amp, torch.device("cpu"))[0] is torch.bfloat16 else "fp32"
    times = {"minimal": [], "control": [], "trainapp": [], "trainapp_novote": [], "trainapp_noranks": []}
    cpu = {k: [] for k in times}  # CPU seconds per step of this process, all its threads (gloo's too)
    # Every contestant in every position equally often, after every other one as often as before it:
    # the rotations of the list and of its reverse (10 orders; the default 20 rounds run each twice).
    names = list(times)
    orders = [names[k:] + names[:k] for k in range(len(names))]
    orders += [list(reversed(o)) for o in orders]
    with scratch("ta-bench-loop-") as tmp:
        tmp = Path(tmp)
        # Round 0 is untimed: it warms up allocators and kernels.
        for r in range(args.rounds + 1):
            for name in orders[(r - 1) % len(orders)]:
                if name.startswith("trainapp"):
                    t, c = trainapp_round(ctx, args.steps, args.batch, tmp / f"{name}-{r}", r,
                                       args.train_size, args.val_size, amp, vote=name != "trainapp_novote",
                                       ranks=name != "trainapp_noranks")
                else:
                    t, c = minimal_round(ctx, args.steps, args.batch, train_ds, val_ds, tmp, seed=r, amp=amp)
                if r > 0:
                    times[name].append(t)
                    cpu[name].append(c)
    if ctx.rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        baseline = statistics.median(times["minimal"] + times["control"])
        rounds = list(zip(times["trainapp"], times["minimal"], times["control"], times["trainapp_novote"],
                          times["trainapp_noranks"]))
        result = {
            "loop_overhead_ratio": statistics.median(t / ((m + c) / 2) for t, m, c, _, _ in rounds),
            "control_ratio": statistics.median(c / m for _, m, c, _, _ in rounds),
            "vote_cost_ratio": statistics.median(t / n for t, _, _, n, _ in rounds),
            # What the per-rank phase timings (observe.ranks) cost: the same loop with them off.
            "ranks_cost_ratio": statistics.median(t / o for t, _, _, _, o in rounds),
            "ranks_cpu_ratio": statistics.median(a / b for a, b in zip(cpu["trainapp"],
                                                                       cpu["trainapp_noranks"])),
            # CPU time is not stretched by waiting for the other rank: a finer view of a small cost.
            "vote_cpu_ratio": statistics.median(a / b for a, b in zip(cpu["trainapp"],
                                                                      cpu["trainapp_novote"])),
            "cpu_control_ratio": statistics.median(a / b for a, b in zip(cpu["control"], cpu["minimal"])),
            "loop_cpu_ratio": statistics.median(
                a / ((b + c) / 2) for a, b, c in zip(cpu["trainapp"], cpu["minimal"], cpu["control"])),
            "loop_overhead_ratio_pooled": med["trainapp"] / baseline,
            "trainapp_step_ms_median": 1000 * med["trainapp"],
            "minimal_step_ms_median": 1000 * baseline,
            **{f"{k}_step_ms_rounds": [round(1000 * t, 2) for t in v] for k, v in times.items()},
            **{f"{k}_cpu_ms_rounds": [round(1000 * t, 2) for t in v] for k, v in cpu.items()},
            "rounds": args.rounds, "steps_per_round": args.steps, "batch_per_worker": args.batch,
            "world_size": ctx.world_size, "backend": ctx.backend, "amp": amp, "model": "smallcnn",
            "torch": torch.__version__, "threads_per_worker": torch.get_num_threads(),
            "machine": describe(),
            "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke, "target": "<= 1.03",
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    tdist.teardown(ctx)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny run that only checks the benchmark works")
    p.add_argument("--rounds", type=int, default=20,
                   help="timed rounds per contestant (each of the 10 orders twice)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per round")
    p.add_argument("--batch", type=int, default=64, help="batch per worker")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--train-size", type=int, default=4096)
    p.add_argument("--val-size", type=int, default=256)
    p.add_argument("--amp", choices=("auto", "bf16", "off"), default="auto",
                   help="amp.dtype of both loops (auto: bf16 where the CPU runs it natively, else fp32)")
    p.add_argument("--out", help="result file (default bench/results/loop_overhead.json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.train_size, args.val_size = 1, 4, 512, 64
    args.out = args.out or str(result_path("loop_overhead.json", args.smoke))
    if args.worker:
        worker(args)
        return 0
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--standalone", f"--nproc_per_node={args.nproc}", "-m", "bench.loop_overhead",
           "--worker", *[a for a in sys.argv[1:] if a != "--worker"], "--out", args.out]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        return rc
    r = json.loads(Path(args.out).read_text())
    print(f"loop_overhead_ratio={r['loop_overhead_ratio']:.3f} control_ratio={r['control_ratio']:.3f} "
          f"vote_cost_ratio={r['vote_cost_ratio']:.3f} vote_cpu_ratio={r['vote_cpu_ratio']:.3f} "
          f"ranks_cost_ratio={r['ranks_cost_ratio']:.3f} ranks_cpu_ratio={r['ranks_cpu_ratio']:.3f} "
          f"(control {r['cpu_control_ratio']:.3f}) trainapp={r['trainapp_step_ms_median']:.1f}ms/step "
          f"minimal={r['minimal_step_ms_median']:.1f}ms/step amp={r['amp']} rounds={r['rounds']} "
          f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
