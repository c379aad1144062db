"""Elastic runs that keep their math (docs/elastic.md): what a resize 2 -> 1 -> 2 changes, and how soon a
returning node trains again.

The math, side by side in one run of this script (the built-in SmallCNN with BatchNorm, fp32, CPU,
2048 synthetic images, 100 steps, a snapshot every 33), for two splits of the global batch: the
default (`train.batch_size=64`, 2 slots of a global batch of 128) and 4 slots (batch 16, grad_accum 2,
global batch 64; not in --smoke):

- straight: torchrun with 2 processes, never resized (the reference);
- keep: the same config, resized 2 -> 1 -> 2 with `train.on_resize=keep` (the default): a rank is
  SIGKILLed after step 34 (the run resumes from step 33 on one process), that process is SIGKILLed after
  step 67 (resumed from 66 on two), then it runs to the end;
- rescale (the control): the same resizes with `train.on_resize=rescale`, the rule before: the global
  batch follows the world size and the peak LR is rescaled;
- one (4 slots only): a straight run on one process with the same global batch: the same math with the
  float sums in another order, which is all a resize changes. Training is chaotic: such a difference of
  1e-9 after one step grows to about 1e-3 after 100.

For each: the relative L2 distance of the final parameters (buffers left out) to the straight run's, and
the relative difference of the final loss. The loss curves of the default split's three runs are drawn
over each other by `trainapp report --compare` (bench/results/resize.png).

The grow-back, on a local multi-node Ray cluster (head + 2 worker nodes, 1 CPU each, on loopback): an
elastic run (`ray.num_workers=[1,2]`, `ray.resize_check_s=10`) loses a worker node (its raylet
SIGKILLed) and goes on on one worker; then a node is started again (`ray start`), and the seconds from
that command to the first step on two workers are measured, split at the node's registration with
Ray and at the `resized` record (the snapshot of the step reached). Not in --smoke: the e2e test
(tests/test_ray.py) runs the same cycle.

    python -m bench.resize            # writes bench/results/resize.json and resize.png
    python -m bench.resize --smoke    # the math on 30 steps only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path


from bench.common import BIN, REPO, records, result_path, wait_for
from bench.machine import describe
from bench.scratch import scratch

from devtools.local_ray import RAY, LocalCluster, free_port

def _run(cmd: list[str], must_pass: bool = True) -> None:
    # The environment as it is now: bench/stream.py adds the tests' user tasks to PYTHONPATH.
    r = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                       text=True, timeout=900)
    if must_pass and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({r.returncode}):\n"
                           f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def _train(procs: int, run_dir: Path, args: list[str], must_pass: bool = True) -> None:
    head = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={procs}", "--max-restarts=0"] \
        if procs > 1 else [str(BIN / "python")]
    _run([*head, "-m", "trainapp", "train", f"run.dir={run_dir}", *args], must_pass)


def resized(run_dir: Path, args: list[str], steps: int, every: int) -> None:
    """2 -> 1 -> 2: a rank killed one step after the first snapshot, the lone process one step after the
    second, then two processes to the end."""
    _train(2, run_dir, [*args, f"drill.kill_at_step={every + 1}", "drill.rank=1"], must_pass=False)
    _train(1, run_dir, [*args, f"drill.kill_at_step={2 * every + 1}", "drill.rank=0"], must_pass=False)
    _train(2, run_dir, args)
    sizes = [r["world_size"] for r in records(run_dir) if r["kind"] == "start"]
    if sizes != [2, 1, 2]:
        raise RuntimeError(f"{run_dir}: world sizes {sizes}, not 2 -> 1 -> 2")


def final(run_dir: Path) -> tuple[dict, float]:
    """(parameters of the newest snapshot without buffers, final loss)."""
    import torch

    from trainapp.snapshots.store import list_snapshots

    state = torch.load(list_snapshots(run_dir / "snapshots")[-1] / "state.pt", weights_only=False)["model"]
    params = {k: v.double() for k, v in state.items() if v.is_floating_point() and "running" not in k}
    return params, next(r for r in reversed(records(run_dir)) if r["kind"] == "end")["final_loss"]


def rel_distance(a: dict, b: dict) -> float:
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5 / sum((a[k] ** 2).sum() for k in a) ** 0.5)


def variant(tmp: Path, steps: int, every: int, split: list[str], floor: bool) -> tuple[dict, dict[str, Path]]:
    """A straight run, the same resized 2 -> 1 -> 2 keeping its global batch, and the control resized with
    the LR rescaled, of one `split` of the global batch; with `floor`, also a straight run on one process
    with the same global batch: what only the order of the float sums changes."""
    args = [f"train.max_steps={steps}", "train.epochs=100", f"snapshot.every_steps={every}", *split,
            "amp.dtype=off", "train.progress=false", "train.log_every=1", "data.train_size=2048",
            "data.val_size=256"]
    runs = {name: tmp / name for name in ("straight", "keep", "rescale", "one")}
    _train(2, runs["straight"], args)
    resized(runs["keep"], args, steps, every)
    resized(runs["rescale"], [*args, "train.on_resize=rescale"], steps, every)
    ref, ref_loss = final(runs["straight"])
    out: dict = {"final_loss_straight": ref_loss}
    if floor:
        gb = next(r["global_batch"] for r in records(runs["straight"]) if r["kind"] == "start")
        _train(1, runs["one"], [*args, f"train.global_batch={gb}"])
    for name in ("keep", "rescale", "one") if floor else ("keep", "rescale"):
        params, loss = final(runs[name])
        out[name] = {"param_rel_distance": rel_distance(params, ref), "final_loss": loss,
                     "final_loss_rel_diff": abs(loss - ref_loss) / ref_loss,
                     "global_batches": [r["global_batch"] for r in records(runs[name])
                                        if r["kind"] == "start"]}
        print(f"{' '.join(split)} {name}: parameters {out[name]['param_rel_distance']:.3g} "
              f"from the straight run's, final loss {loss:.5f} (straight {ref_loss:.5f}), "
              f"global batch by attempt {out[name]['global_batches']}",
              flush=True)
    return out, runs


def math(tmp: Path, steps: int, every: int, png: Path, smoke: bool) -> dict:
    """The default split (train.batch_size=64: a global batch of 2 slots, one per rank on two, both on one:
    a + b is b + a, so the resized run is bitwise equal), and, not in --smoke, 4 slots (batch 16,
    grad_accum 2), where the sums are added in another order, with that order's own effect beside it."""
    two, runs = variant(tmp / "two", steps, every, ["train.batch_size=64"], floor=False)
    _run([str(BIN / "python"), "-m", "trainapp", "report", str(runs["keep"]), "--compare",
          str(runs["straight"]), str(runs["rescale"]), "--out", str(png)])
    keep, rescale = two["keep"], two["rescale"]
    out = {"resize_param_rel_distance": keep["param_rel_distance"],
           "resize_param_rel_distance_rescale": rescale["param_rel_distance"],
           "resize_bitwise_equal": keep["param_rel_distance"] == 0.0,
           # None when the resized run is bitwise equal: no ratio to take
           "rescale_over_keep": rescale["param_rel_distance"] / keep["param_rel_distance"]
           if keep["param_rel_distance"] else None,
           "resize_final_loss_rel_diff": keep["final_loss_rel_diff"],
           "resize_final_loss_rel_diff_rescale": rescale["final_loss_rel_diff"], "math_two_slots": two,
           "math_steps": steps}
    if not smoke:
        four, _ = variant(tmp / "four", steps, every, ["train.batch_size=16", "train.grad_accum=2"],
                          floor=True)
        out.update({"resize_param_rel_distance_4slots": four["keep"]["param_rel_distance"],
                    "resize_param_rel_distance_4slots_rescale": four["rescale"]["param_rel_distance"],
                    "float_order_floor_4slots": four["one"]["param_rel_distance"],
                    "resize_final_loss_rel_diff_4slots": four["keep"]["final_loss_rel_diff"],
                    "resize_final_loss_rel_diff_4slots_rescale": four["rescale"]["final_loss_rel_diff"],
                    "math_four_slots": four})
    return out


class GrowBack:
    """The lost-node-and-back cycle on a local Ray cluster."""

    def __init__(self, storage: Path):
        self.storage = storage
        self.cluster = LocalCluster(Path(f"/tmp/ta-bench-{uuid.uuid4().hex[:6]}"), workers=2, cpus=1,
                                    gcs_port=free_port(), dashboard_port=free_port())
        self.run_dir = storage / "grow"
        self.startup_s: float | None = None
        """`ray job submit` to the first step, of the run `measure` made."""

    def submit(self) -> None:
        cmd = [RAY, "job", "submit", "--address", self.cluster.dashboard_url, "--submission-id", "grow",
               "--no-wait", "--", "python", "-m", "trainapp", "ray", f"ray.storage_path={self.storage}",
               "ray.name=grow", "ray.num_workers=[1,2]", "ray.resize_check_s=10",
               "ray.worker_group_start_timeout_s=15", "train.max_steps=100000", "train.epochs=1000",
               "snapshot.every_steps=200", "train.progress=false", "train.log_every=1",
               "data.train_size=2048", "data.val_size=256", "drill.slow_rank=0", "drill.slow_ms=50"]
        subprocess.run(cmd, cwd=REPO, env=self.cluster.env(), check=True, capture_output=True, timeout=120)

    def _train_at(self, world: int, after: float) -> dict:
        found: list[dict] = []

        def seen() -> bool:
            found[:] = [r for r in records(self.run_dir) if r["kind"] == "train" and r["world_size"] == world
                        and r["time"] > after]
            return bool(found)

        wait_for(seen, 600, f"a step on {world} worker(s)")
        return found[0]

    def cycle(self, i: int) -> dict:
        """Lose the newest worker node, train on one, start a node again: seconds to two workers."""
        lost = self.cluster.nodes[-1].name
        t_kill = time.time()
        os.kill(self.cluster.node_pids(lost)["raylet"], signal.SIGKILL)
        shrunk = self._train_at(1, t_kill)
        time.sleep(5)
        alive = self.cluster.alive_nodes()
        t0 = time.time()
        self.cluster.add_worker(f"back{i}", REPO)
        wait_for(lambda: self.cluster.alive_nodes() > alive, 300, "the node's registration")
        t_node = time.time()
        first = self._train_at(2, t0)
        resize = [r for r in records(self.run_dir) if r["kind"] == "resized" and r["time"] > t0]
        out = {"grow_back_seconds": first["time"] - t0, "node_lost_to_one_worker_s": shrunk["time"] - t_kill,
               "node_registered_s": t_node - t0,
               "resized_s": resize[0]["time"] - t0 if resize else None,
               "redone_steps": None}
        starts = [r for r in records(self.run_dir) if r["kind"] == "start" and r["time"] > t0]
        if resize and starts:
            out["redone_steps"] = resize[0]["step"] - starts[0]["resumed_step"]
        print(json.dumps({"cycle": i, **{k: round(v, 2) if isinstance(v, float) else v
                                         for k, v in out.items()}}),
              flush=True)
        return out

    def measure(self, cycles: int) -> list[dict]:
        self.cluster.up(cwd=REPO)
        try:
            t0 = time.time()
            self.submit()
            self.startup_s = self._train_at(2, t0)["time"] - t0  # `ray job submit` to the first step's record
            wait_for(lambda: any(r["kind"] == "train" and r["world_size"] == 2 and r["step"] >= 10
                                 for r in records(self.run_dir)), 600, "step 10 on 2 workers")
            out = [self.cycle(i) for i in range(cycles)]
            subprocess.run([RAY, "job", "stop", "grow", "--address", self.cluster.dashboard_url], cwd=REPO,
                           env=self.cluster.env(), capture_output=True, timeout=120)
            return out
        finally:
            self.cluster.down(grace=5)
            shutil.rmtree(self.cluster.dir, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the math on 30 steps, no Ray cluster")
    p.add_argument("--cycles", type=int, default=3, help="lost-and-back cycles on the Ray cluster")
    p.add_argument("--out", help="result file (default bench/results/resize.json)")
    args = p.parse_args()
    folder = result_path("", args.smoke)
    out = Path(args.out or folder / "resize.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    steps, every = (30, 10) if args.smoke else (100, 33)
    with scratch("ta-bench-resize-") as tmp:
        result = math(Path(tmp), steps, every, out.with_suffix(".png"), args.smoke)
        cycles = [] if args.smoke else GrowBack(Path(tmp) / "storage").measure(args.cycles)
    if cycles:
        for key in ("grow_back_seconds", "node_lost_to_one_worker_s", "node_registered_s", "resized_s"):
            result[key] = statistics.median(c[key] for c in cycles if c[key] is not None)
        result["grow_back_redone_steps"] = max((c["redone_steps"] or 0) for c in cycles)
    result.update({"cycles": cycles, "smoke": args.smoke, "machine": describe(),
                   "date": time.strftime("%Y-%m-%d"),
                   "targets": {"resize_param_rel_distance": "<= 1e-4", "rescale_over_keep": ">= 100",
                               "grow_back_seconds": "<= 30"}})
    out.write_text(json.dumps(result, indent=2) + "\n")
    ratio = f"{result['rescale_over_keep']:.0f}x" if result["rescale_over_keep"] else "bitwise equal"
    print(f"resize_param_rel_distance={result['resize_param_rel_distance']:.3g} (rescale control "
          f"{result['resize_param_rel_distance_rescale']:.3g}, {ratio})"
          + (f"; grow_back_seconds={result['grow_back_seconds']:.1f}" if cycles else "") + f" -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
