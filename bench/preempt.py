"""Preemption: from SIGTERM to the snapshot of the step reached, for a resnet18 run under torchrun.

Each run is a real `torchrun --nproc_per_node=2` job (resnet18, 32-pixel synthetic images, SGD with
momentum, so the snapshot holds the weights and a momentum buffer of the same size) that writes a
periodic snapshot every 4 steps; once it has trained past one, the whole process group gets SIGTERM,
as a container runtime sends it. `preempt_seconds` is the median of the `preempted` records' seconds
(rank 0's first notice to its snapshot on disk: the agreement at the next step boundary, that step,
the write). Beside it, per run: a periodic snapshot's blocking time of the same state
(`periodic_snapshot_seconds`, the write alone), the step time, and the wall time from the signal to
torchrun's exit.

The vote that agrees on the stop step is also measured alone, where nothing else moves the numbers:
two gloo ranks spin 10 ms per step (a stand-in for compute) with and without trainapp's `StopVote`
voting at every step; `vote_cpu_ms` / `vote_wall_ms` are the extra CPU and wall time per vote
(medians of alternating blocks). The loop votes about every `StopVote.INTERVAL_S`, so
`vote_share` (vote CPU over that interval) is what it costs a run.

    python -m bench.preempt            # writes bench/results/preempt.json
    python -m bench.preempt --smoke    # smallcnn, one run; for CI, writes bench/results/smoke/
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, result_path
from bench.machine import describe
from bench.scratch import scratch


from trainapp.observe.metrics import read


def one_run(run_dir: Path, model: str, signal_after: int, timeout: float = 600) -> dict:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", "--max-restarts=0", "-m", "trainapp", "train",
           f"run.dir={run_dir}", f"model.name={model}", "data.train_size=2048", "data.val_size=64",
           "train.batch_size=16", "train.epochs=1000", "train.max_steps=10000", "train.log_every=1",
           "train.progress=false", "snapshot.every_steps=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINAPP_RUNTIME_DIR": str(run_dir / "rt")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not any(r["step"] >= signal_after for r in read(run_dir, "train", missing_ok=True)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"preempt bench: run ended or stalled before step {signal_after}: "
                                 f"{proc.stderr.read()[-2000:]}")
            time.sleep(0.02)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        wall = time.monotonic() - t0
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    (rec,) = read(run_dir, "preempted")
    periodic = [r["blocking_s"] for r in read(run_dir, "snapshot") if r["step"] != rec["step"]]
    train = read(run_dir, "train")
    step_s = (train[-1]["time"] - train[1]["time"]) / max(1, train[-1]["step"] - train[1]["step"])
    return {"preempt_seconds": rec["seconds"], "stop_step": rec["step"],
            "periodic_snapshot_seconds": max(periodic), "step_seconds": step_s,
            "signal_to_exit_seconds": wall,
            "snapshot_bytes": json.loads((Path(rec["snapshot"]) / "meta.json").read_text())["bytes"]}


def vote_worker(blocks: int, steps: int) -> None:
    """Under torchrun: alternating blocks of spinning steps with and without a vote at each step."""
    import torch.distributed as dist

    from trainapp.faults.guard import RankGuard
    from trainapp.faults.boundary import StopVote
    from trainapp.config import DistSection
    from trainapp.launch import dist as tdist

    ctx = tdist.setup(DistSection(timeout_s=60))
    vote = StopVote(ctx, RankGuard().notices)
    vote.INTERVAL_S = 0.0  # every step: one vote per step is what is measured
    cost, base = {"cpu": [], "wall": []}, (0.0, 0.0)
    for b in range(2 * blocks):
        voting = b % 2 == 1
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(steps):
            end = time.perf_counter() + 0.010
            while time.perf_counter() < end:
                pass
            if voting:
                assert vote.stop(b * steps + i) == 0
        vote.close()
        c, t = (time.process_time() - c0) / steps, (time.perf_counter() - t0) / steps
        if voting:
            cost["cpu"].append(c - base[0])
            cost["wall"].append(t - base[1])
        base = (c, t)
    if ctx.is_main:
        print(json.dumps({k: 1000 * statistics.median(v) for k, v in cost.items()}), flush=True)
    tdist.teardown(ctx)


def measure_vote(blocks: int) -> dict:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    r = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", __file__, "--vote-worker",
                        str(blocks)], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"preempt bench: vote measurement failed: {r.stderr[-2000:]}")
    ms = json.loads(r.stdout.strip().splitlines()[-1])
    return {"vote_cpu_ms": ms["cpu"], "vote_wall_ms": ms["wall"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="smallcnn, one run: only checks the benchmark works")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", help="result file (default bench/results/preempt.json)")
    p.add_argument("--vote-worker", type=int, metavar="BLOCKS", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.vote_worker:
        vote_worker(args.vote_worker, steps=200)
        return 0
    model, runs = ("smallcnn", 1) if args.smoke else ("resnet18", args.runs)
    out = result_path("preempt.json", args.smoke, args.out)
    results = []
    with scratch("ta-bench-preempt-") as tmp:
        for i in range(runs):
            r = one_run(Path(tmp) / f"run{i}", model, signal_after=6)
            print(f"run {i}: " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in r.items()),
                  flush=True)
            results.append(r)
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    from trainapp.faults.boundary import StopVote

    vote = measure_vote(2 if args.smoke else 10)
    result = {"preempt_seconds": med["preempt_seconds"],
              "periodic_snapshot_seconds": med["periodic_snapshot_seconds"],
              "step_seconds": med["step_seconds"], "signal_to_exit_seconds": med["signal_to_exit_seconds"],
              "snapshot_bytes": int(med["snapshot_bytes"]),
              **vote, "vote_share": vote["vote_cpu_ms"] / (1000 * StopVote.INTERVAL_S),
              "vote_interval_s": StopVote.INTERVAL_S, "runs": results, "model": model, "world_size": 2,
              "machine": describe(),
              "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke, "target": "< preempt.grace_s (25 s)"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"preempt_seconds={med['preempt_seconds']:.3f} "
          f"(periodic snapshot {med['periodic_snapshot_seconds']:.3f} s, step {med['step_seconds']:.3f} s, "
          f"signal to exit {med['signal_to_exit_seconds']:.2f} s); one vote "
          f"{vote['vote_cpu_ms']:.3f} ms CPU, {vote['vote_wall_ms']:.3f} ms wall -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
