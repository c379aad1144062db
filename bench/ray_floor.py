"""Ray Train's floor: the CPU a training worker pays per step for running inside Ray Train at all,
beside what trainapp pays, in one run.

`launchers` finds a trainapp worker under Ray Train using 2-3% more CPU per step than under torchrun.
This benchmark asks how much of that any loop pays. A minimal hand-written DDP loop (SmallCNN on
in-memory synthetic images, autocast in bf16 where the CPU runs it natively, SGD; no snapshot, no
report, nothing Ray-specific in its steps) runs under torchrun and inside a bare `TorchTrainer`
(Ray Train's defaults, its own gloo process group); trainapp runs under torchrun and under
`trainapp ray` with the `launchers` benchmark's config. All on the `launchers` local cluster (a head
and 2 worker nodes of 1 CPU, on loopback), 2 workers of one thread each.

Each minimal worker measures its own process's CPU time (every thread) and its training thread's CPU
time over the steps after a warm-up; trainapp's workers measure theirs (`cpu_ms` in the `ranks`
records). A round runs torchrun, the Ray run(s), torchrun for each loop (the minimal loop first in
even rounds, trainapp first in odd ones); each Ray run is compared with the mean of the two torchrun
runs around it, the second torchrun with the first is the noise floor, and each ratio is the median
over rounds. The minimal loop's Ray runs are VARIANTS (`--variants`): by default the bare loop and
the loop with a report every 10 steps at trainapp's poll interval. trainapp's are TRAINAPP_VARIANTS
(`--trainapp-variants`): by default its defaults, which register a snapshot with Ray about every
`ray.report_interval_s`; `ray_every` registers every snapshot (10 steps), the rate of the minimal
loop's `ray_report`.

    python -m bench.ray_floor            # writes bench/results/ray_floor.json
    python -m bench.ray_floor --smoke    # one short round
    python -m bench.ray_floor --no-trainapp --variants ray,ray_poll,ray_report,ray_report50
    python -m bench.ray_floor --no-minimal --trainapp-variants ray,ray_every
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


from bench.common import BIN, REPO, result_path
from bench.launchers import Bench, paired, parser
from bench.machine import describe
from bench.scratch import scratch


def floor_loop(cfg: dict) -> None:
    """The minimal DDP loop, in a torchrun worker or a Ray Train worker (whose process group Ray Train
    formed); writes this rank's CPU and wall time per step over the steps after `warmup`, and the
    training thread's CPU in `ray.train.report` and in the garbage collector."""
    import gc
    import threading

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from trainapp.core.amp import resolve_dtype
    from trainapp.tasks.image import SmallCNN, SyntheticImages

    torch.set_num_threads(1)
    under_ray = dist.is_initialized()  # Ray Train formed the group; under torchrun the environment names it
    if not under_ray:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(SmallCNN(10).to(memory_format=torch.channels_last))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    dtype = resolve_dtype("auto", torch.device("cpu"))[0]
    ds = SyntheticImages(cfg["train_size"], 10, 32, 0, "train")
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg["batch"], sampler=sampler, drop_last=True)
    report = cfg.get("report_every", 0)
    if report:
        import ray.train
    trainer_thread = threading.current_thread()
    gc_time = [0.0, 0.0]  # this thread's CPU seconds in the collector, and when the running one began

    def on_gc(phase, info):
        if threading.current_thread() is trainer_thread:
            if phase == "start":
                gc_time[1] = time.thread_time()
            else:
                gc_time[0] += time.thread_time() - gc_time[1]

    gc.callbacks.append(on_gc)
    done, epoch, mark, report_time = 0, 0, None, 0.0
    while done < cfg["steps"]:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if done == cfg["warmup"]:
                mark = (time.perf_counter(), time.process_time(), time.thread_time())
                gc0, gc_time[0] = [g["collections"] for g in gc.get_stats()], 0.0
            x = x.to(memory_format=torch.channels_last)  # as trainapp's default model.channels_last
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if report and done % report == 0:
                r0 = time.thread_time()
                ray.train.report({"step": done, "loss": loss.item()})
                if mark:
                    report_time += time.thread_time() - r0
            if done == cfg["steps"]:
                break
        epoch += 1
    now = (time.perf_counter(), time.process_time(), time.thread_time())
    wall, cpu, thread = (b - a for a, b in zip(mark, now))
    n = cfg["steps"] - cfg["warmup"]
    gc.callbacks.remove(on_gc)
    out = {"rank": rank, "step_ms": 1000 * wall / n, "cpu_ms": 1000 * cpu / n,
           "thread_cpu_ms": 1000 * thread / n,
           "gc_ms": 1000 * gc_time[0] / n, "report_ms": 1000 * report_time / n,
           "gc_collections": [g["collections"] - c for g, c in zip(gc.get_stats(), gc0)],
           "gc_objects": len(gc.get_objects()),
           "main_thread": threading.current_thread() is threading.main_thread()}
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    if not under_ray:  # Ray Train destroys the group it formed
        dist.destroy_process_group()


def ray_driver(cfg: dict, storage: str) -> None:
    """A bare TorchTrainer, as a user would write it: Ray Train's defaults, but the controller's poll
    interval where `poll_s` is set."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if cfg.get("poll_s"):
        from trainapp.launch.ray.private.controller import HEALTH_CHECK_INTERVAL_S_ENV_VAR

        os.environ[HEALTH_CHECK_INTERVAL_S_ENV_VAR] = str(cfg["poll_s"])
    TorchTrainer(floor_loop, train_loop_config=cfg,
                 scaling_config=ScalingConfig(num_workers=cfg["workers"], resources_per_worker={"CPU": 1}),
                 torch_config=TorchConfig(backend="gloo"),
                 run_config=RunConfig(storage_path=storage, name="floor")).fit()


# The minimal loop's Ray runs: (a metrics report every N steps, the controller's poll interval in s).
# trainapp polls every `ray.health_check_interval_s` (0.25 s), because a report waits until the
# controller has taken the previous one, and Ray's 2 s would stall a report every 10 steps.
VARIANTS = {
    "ray": (0, None),  # Ray Train's defaults, nothing Ray-specific in the steps
    "ray_poll": (0, 0.25),  # trainapp's poll interval, no report
    "ray_report": (10, 0.25),  # and a report every 10 steps, as the `launchers` runs' snapshots
    "ray_report50": (50, 0.25),  # a report every 50 steps, as trainapp's default snapshot interval
}

# trainapp's Ray runs: their overrides of the `launchers` config.
TRAINAPP_VARIANTS = {
    "ray": (),  # trainapp's defaults: a snapshot registered with Ray about every ray.report_interval_s
    "ray_every": ("ray.report_interval_s=0",),  # every snapshot registered
}


class Floor:
    """The minimal loop's runs, on the cluster of a `launchers` Bench."""

    def __init__(self, bench: Bench, args):
        self.b, self.args = bench, args

    def run(self, launcher: str, name: str) -> dict:
        """`launcher`: torchrun, or one of VARIANTS: a bare TorchTrainer."""
        out = self.b.work / f"floor-{name}"
        out.mkdir()
        report_every, poll_s = VARIANTS.get(launcher, (0, None))
        cfg = {"steps": self.args.steps, "warmup": self.args.warmup, "batch": 64, "train_size": 2048,
               "workers": 2, "out": str(out), "report_every": report_every, "poll_s": poll_s}
        if launcher == "torchrun":
            cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={cfg['workers']}", "-m",
                   "bench.ray_floor", "--worker", json.dumps(cfg)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
        else:
            cmd = [str(BIN / "ray"), "job", "submit", "--address", self.b.cluster.dashboard_url, "--",
                   "python", "-m", "bench.ray_floor", "--driver", json.dumps(cfg), "--storage", str(out)]
            env = self.b.cluster.env()
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        self.b.procs.append(p)
        if p.wait(timeout=900) != 0:
            raise RuntimeError(f"floor run failed: {cmd}")
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(cfg["workers"])]
        fields = ("step_ms", "cpu_ms", "thread_cpu_ms", "gc_ms", "report_ms")
        means = {k: statistics.fmean(r[k] for r in ranks) for k in fields}
        return means | {"main_thread": [r["main_thread"] for r in ranks],
                        "gc_collections": ranks[0]["gc_collections"], "gc_objects": ranks[0]["gc_objects"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one short round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=450,
                   help="steps of a minimal run (the first --warmup untimed)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--trainapp-steps", type=int, default=400, help="steps of a trainapp run")
    p.add_argument("--variants", default="ray,ray_report",
                   help=f"the minimal loop's Ray runs in a round, comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--trainapp-variants", default="ray",
                   help=f"trainapp's Ray runs in a round, comma-separated, of: "
                        f"{', '.join(TRAINAPP_VARIANTS)}")
    p.add_argument("--no-trainapp", action="store_true", help="the minimal loop only")
    p.add_argument("--no-minimal", action="store_true", help="trainapp only")
    p.add_argument("--out", help="result file (default bench/results/ray_floor.json)")
    # Internal: a minimal worker under torchrun, and the Ray job's driver.
    p.add_argument("--worker", metavar="CFG", help=argparse.SUPPRESS)
    p.add_argument("--driver", metavar="CFG", help=argparse.SUPPRESS)
    p.add_argument("--storage", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        floor_loop(json.loads(args.worker))
        return 0
    if args.driver:
        ray_driver(json.loads(args.driver), args.storage)
        return 0
    for option, given, known in (("--variants", args.variants, VARIANTS),
                                 ("--trainapp-variants", args.trainapp_variants, TRAINAPP_VARIANTS)):
        unknown = [v for v in given.split(",") if v not in known]
        if unknown:
            p.error(f"{option}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.no_trainapp and args.no_minimal:
        p.error("--no-trainapp and --no-minimal: nothing left to run; drop one")
    if args.smoke:
        args.rounds, args.steps, args.warmup, args.trainapp_steps = 1, 60, 20, 40
    out = result_path("ray_floor.json", args.smoke, args.out)
    # The `launchers` Bench with that benchmark's defaults: its cluster and its trainapp runs.
    bench_args = parser().parse_args(["--steps", str(args.trainapp_steps)] + ["--smoke"] * args.smoke)
    # Each loop's contestants in a round; the first and last (torchrun) are each Ray run's neighbours.
    order = {"minimal": ("torchrun", *args.variants.split(","), "torchrun"),
             "trainapp": ("torchrun", *args.trainapp_variants.split(","), "torchrun")}
    for loop in ("trainapp", "minimal"):
        if getattr(args, f"no_{loop}"):
            del order[loop]
    runs: dict[str, dict[str, list[dict]]] = {loop: {c: [] for c in cs} for loop, cs in order.items()}
    ratios: dict[str, list[float]] = {}
    with scratch("ta-bench-floor-") as tmp:
        b = Bench(bench_args, Path(tmp))
        floor = Floor(b, args)
        try:
            b.cluster.up(cwd=REPO)
            for i in range(args.rounds):
                for loop in (tuple(order) if i % 2 == 0 else tuple(order)[::-1]):
                    got = []
                    for j, launcher in enumerate(order[loop]):
                        if loop == "minimal":
                            run = floor.run(launcher, f"{i}{j}")
                        else:
                            plain = b.plain_run("ray" if launcher in TRAINAPP_VARIANTS else launcher,
                                                f"{i}{j}", 2, *TRAINAPP_VARIANTS.get(launcher, ()))
                            run = {"cpu_ms": plain["train_cpu_ms_per_step"],
                                   "step_ms": 1000 * statistics.median(plain["steps"]), "thread_cpu_ms": None}
                        runs[loop][launcher].append(run)
                        got.append((launcher, run))
                        print(f"round {i}, {loop} loop, {launcher}: {run['cpu_ms']:.2f} ms CPU per step, "
                              f"{run['step_ms']:.2f} ms per step"
                              + (f", training thread {run['thread_cpu_ms']:.2f} ms, "
                                 f"of it {run['report_ms']:.2f} ms in reports and {run['gc_ms']:.2f} ms in "
                                 f"the garbage collector (collections by generation {run['gc_collections']}, "
                                 f"{run['gc_objects']} objects)" if run["thread_cpu_ms"] else ""),
                              flush=True)
                    for field, key in (("cpu_ms", "cpu"), ("step_ms", "step"),
                                       ("thread_cpu_ms", "thread_cpu")):
                        if not got[0][1][field]:
                            continue  # trainapp's runs have no thread CPU
                        each, control = paired([run[field] for _, run in got])
                        for (launcher, _), ratio in zip(got[1:-1], each):
                            ratios.setdefault(f"{loop}_{key}_ratio{launcher[3:]}", []).append(ratio)
                        ratios.setdefault(f"{loop}_{key}_control_ratio", []).append(control)
                    print(f"round {i}, {loop} loop: CPU per step " + ", ".join(
                        f"{k.removeprefix(loop + '_')} {v[-1]:.3f}" for k, v in ratios.items()
                        if k.startswith(f"{loop}_cpu")), flush=True)
        finally:
            b.close()
    result: dict = {}
    for key, values in ratios.items():
        result[key] = statistics.median(values)
        result[f"{key}_per_round"] = [round(v, 3) for v in values]
    # trainapp's own cost under Ray, beside Ray Train's floor: per round, trainapp's ratio against the
    # minimal loop's (bare, and with trainapp's report rate).
    for suffix in ("", "_report"):
        pairs = list(zip(ratios.get("trainapp_cpu_ratio", []), ratios.get(f"minimal_cpu_ratio{suffix}", [])))
        if pairs:
            result[f"trainapp_vs_minimal{suffix}_cpu_ratio"] = statistics.median(t / m for t, m in pairs)
    for loop, contestants in runs.items():
        for launcher, got in contestants.items():
            # The minimal loop's training thread also times its reports and garbage collections.
            for field in ("cpu_ms", "step_ms", "thread_cpu_ms", "report_ms", "gc_ms"):
                values = [r[field] for r in got if r.get(field) is not None]
                if values:
                    result[f"{loop}_{field}_{launcher}"] = statistics.median(values)
    for launcher in order.get("minimal", ())[:-1]:
        # CPU outside the training thread (gloo's threads; in a Ray worker also Ray's own).
        if f"minimal_thread_cpu_ms_{launcher}" in result:
            result[f"minimal_other_threads_ms_per_step_{launcher}"] = (
                result[f"minimal_cpu_ms_{launcher}"] - result[f"minimal_thread_cpu_ms_{launcher}"])
    if "minimal" in order:
        result["minimal_training_in_main_thread"] = {launcher: runs["minimal"][launcher][0]["main_thread"]
                                                     for launcher in order["minimal"]}
        result["variants"] = {v: {"report_every": VARIANTS[v][0], "poll_s": VARIANTS[v][1]}
                              for v in order["minimal"][1:-1]}
    if "trainapp" in order:
        result["trainapp_variants"] = {v: list(TRAINAPP_VARIANTS[v]) for v in order["trainapp"][1:-1]}
    result.update({"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                   "trainapp_steps": args.trainapp_steps, "workers": 2, "threads_per_worker": 1,
                   "smoke": args.smoke, "machine": describe(), "date": time.strftime("%Y-%m-%d"),
                   "target": "information: the floor under launchers' "
                             "train_cpu_ratio_ray_vs_torchrun (<= 1.02)"})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()
                      if not isinstance(v, (dict, list))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
