"""Launchers and recovery: the same trainapp config under torchrun and under Ray Train on a local
multi-node Ray cluster (head + 2 worker nodes, 1 CPU each, on loopback).

Measured from the runs' own metrics.jsonl (one record per step, wall-clock `time`):
- startup: seconds from launching (`torchrun ...` / `ray job submit ...`) to the first optimizer step;
- steady-state step time: median gap between consecutive step records (snapshot steps left out),
  in rounds of torchrun, Ray, torchrun back to back; `ray_vs_torchrun_step_ratio` is the median
  over rounds of Ray / the mean of its two torchrun neighbours, and `control_ratio` the median of
  the second torchrun / the first (the noise floor). Step times on a shared VM drift by 20% between
  runs minutes apart, more than the difference measured, so each ratio compares neighbours in time
  (the pooled ratio is reported too);
- recovery: seconds from SIGKILL of one training worker (found through Ray's state API) to the first
  step after the restarted group resumed from its snapshot (and the same for torchrun, whose
  agent restarts the group, for comparison);
- node loss: an elastic run (`ray.num_workers=[1,2]`) loses a whole worker node (its raylet is
  SIGKILLed); seconds until the first step on the remaining worker.

    python bench/launchers.py            # writes bench/results/launchers.json
    python bench/launchers.py --smoke    # one short run per launcher, no faults
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from machine import describe  # noqa: E402
from trainapp.ray_local import LocalCluster, free_port  # noqa: E402

BIN = Path(sys.executable).parent


def records(run_dir: Path) -> list[dict]:
    try:
        with open(run_dir / "metrics.jsonl") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if r["kind"] == "train"]


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def step_times(run_dir: Path, snapshot_every: int) -> list[float]:
    """Gaps between consecutive step records of the first attempt, skipping snapshot steps."""
    out, prev = [], None
    for r in records(run_dir):
        if r["kind"] == "start" and prev is not None:
            break
        if r["kind"] != "train":
            continue
        if prev is not None and r["step"] == prev["step"] + 1 and prev["step"] % snapshot_every != 0:
            out.append(r["time"] - prev["time"])
        prev = r
    return out[2:]  # the first steps warm up


def steal_seconds() -> float:
    """CPU time the hypervisor gave to other guests (all cores), from /proc/stat; 0 where not reported."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def first_step_after_restart(run_dir: Path) -> float | None:
    seen_start = 0
    for r in records(run_dir):
        if r["kind"] == "start":
            seen_start += 1
        elif r["kind"] == "train" and seen_start >= 2:
            return r["time"]
    return None


class Bench:
    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.cluster = LocalCluster(Path(f"/tmp/ta-bench-{uuid.uuid4().hex[:6]}"), workers=2, cpus=1,
                                    gcs_port=free_port(), dashboard_port=free_port(),
                                    head_nice=args.head_nice, worker_nice=args.worker_nice)
        self.procs: list[subprocess.Popen] = []

    def cfg(self, *extra: str) -> list[str]:
        a = self.args
        return [f"train.max_steps={a.steps}", "train.epochs=100", f"snapshot.every_steps={a.snapshot_every}",
                "train.log_every=1", "train.progress=false", "data.train_size=2048", "data.val_size=256", *extra]

    def launch(self, launcher: str, run_dir: Path, *extra: str) -> tuple[subprocess.Popen, float]:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if launcher == "torchrun":
            cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "--max-restarts=1", "-m", "trainapp",
                   "train", f"run.dir={run_dir}", *self.cfg(*extra)]
        else:
            env = self.cluster.env()
            cmd = [str(BIN / "ray"), "job", "submit", "--address", self.cluster.dashboard_url, "--", "python", "-m",
                   "trainapp", "ray", f"ray.storage_path={run_dir.parent}", f"ray.name={run_dir.name}",
                   "ray.max_failures=2", *self.cfg(*extra)]
        t0 = time.time()
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        self.procs.append(p)
        return p, t0

    def finish(self, p: subprocess.Popen) -> None:
        if p.wait(timeout=900) != 0:
            raise RuntimeError(f"run failed: {p.args}")

    def plain_run(self, launcher: str, i: str) -> tuple[float, list[float], float]:
        """Startup seconds, steady step times, and the CPU seconds stolen by other VMs meanwhile."""
        run_dir = self.work / f"{launcher}-{i}"
        steal0 = steal_seconds()
        p, t0 = self.launch(launcher, run_dir)
        self.finish(p)
        first = train_records(run_dir)[0]["time"]
        return first - t0, step_times(run_dir, self.args.snapshot_every), steal_seconds() - steal0

    def kill_run(self, launcher: str, what: str) -> float:
        """Kill a worker (or a worker node) at step args.kill_step; seconds to the first step after resume."""
        run_dir = self.work / f"{launcher}-{what}"
        extra = ["ray.num_workers=[1,2]", f"ray.worker_group_start_timeout_s={self.args.start_timeout}"] \
            if what == "node" else []
        p, _ = self.launch(launcher, run_dir, *extra)
        wait_for(lambda: any(r["step"] >= self.args.kill_step for r in train_records(run_dir)), 600, "kill step")
        if what == "node":
            victim = self.cluster.node_pids("worker2")["raylet"]
        elif launcher == "ray":
            victim = self.cluster.state("actors", class_name="RayTrainWorker", state="ALIVE")[-1]["pid"]
        else:
            victim = max(_children(p.pid))  # torchrun's children are its worker processes
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        self.finish(p)
        t_first = first_step_after_restart(run_dir)
        if t_first is None:
            raise RuntimeError(f"{run_dir}: no restart recorded")
        return t_first - t_kill

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        self.cluster.down()
        subprocess.run(["rm", "-rf", str(self.cluster.dir)], check=False)


def _quiet_median(ratios: list[float], steal: list[float], limit: float = 1.0) -> float | None:
    quiet = [r for i, r in enumerate(ratios) if max(steal[3 * i:3 * i + 3]) < limit]
    return statistics.median(quiet) if quiet else None


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one short run per launcher, no faults")
    p.add_argument("--rounds", type=int, default=6, help="rounds of torchrun, Ray, torchrun runs")
    p.add_argument("--no-faults", action="store_true", help="step times and startup only: no kills")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--snapshot-every", type=int, default=10)
    p.add_argument("--kill-step", type=int, default=25)
    p.add_argument("--start-timeout", type=float, default=10.0,
                   help="ray.worker_group_start_timeout_s for the node-loss run (Ray's default: 60)")
    p.add_argument("--head-nice", type=int, default=LocalCluster.head_nice, help="nice value of the head's processes")
    p.add_argument("--worker-nice", type=int, default=LocalCluster.worker_nice,
                   help="nice value of Ray's worker processes (Ray's default: 15)")
    p.add_argument("--out", help="result file (default bench/results/launchers.json)")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 12
    out = Path(args.out or HERE / "results" / ("smoke" if args.smoke else "") / "launchers.json")
    with tempfile.TemporaryDirectory(prefix="ta-bench-") as tmp:
        b = Bench(args, Path(tmp))
        try:
            t = time.time()
            b.cluster.up(cwd=REPO)
            cluster_up = time.time() - t
            print(f"cluster up in {cluster_up:.1f}s", flush=True)
            startup = {"torchrun": [], "ray": []}
            steps = {"torchrun": [], "ray": []}
            ratios, controls, steal = [], [], []
            for i in range(args.rounds):
                # torchrun, Ray, torchrun: Ray's run is compared with the mean of its two neighbours in
                # time, which cancels drift that is linear over the round; the torchrun pair gives the
                # noise floor of the same comparison.
                medians = []
                for j, launcher in enumerate(("torchrun", "ray", "torchrun")):
                    s, st, stolen = b.plain_run(launcher, f"{i}{j}")
                    steal.append(round(stolen, 1))
                    startup[launcher].append(s)
                    steps[launcher].extend(st)
                    medians.append(statistics.median(st))
                    print(f"{launcher} run {i}.{j}: startup {s:.1f}s, median step {1000 * medians[-1]:.1f}ms, "
                          f"steal {stolen:.1f}s", flush=True)
                ratios.append(medians[1] / ((medians[0] + medians[2]) / 2))
                controls.append(medians[2] / medians[0])
                print(f"round {i}: ray/torchrun {ratios[-1]:.3f}, torchrun/torchrun {controls[-1]:.3f}", flush=True)
            result = {"cluster_up_seconds": cluster_up}
            if args.rounds:  # --rounds 0: the fault runs only
                result.update({
                    "ray_vs_torchrun_step_ratio": statistics.median(ratios),
                    "ray_vs_torchrun_step_ratio_per_round": [round(r, 3) for r in ratios],
                    "control_torchrun_vs_torchrun_per_round": [round(r, 3) for r in controls],
                    "control_ratio": statistics.median(controls),
                    "ray_vs_torchrun_step_ratio_pooled": statistics.median(steps["ray"]) / statistics.median(steps["torchrun"]),
                    "startup_seconds_ray": statistics.median(startup["ray"]),
                    "startup_seconds_torchrun": statistics.median(startup["torchrun"]),
                    "step_ms_ray": 1000 * statistics.median(steps["ray"]),
                    "step_ms_torchrun": 1000 * statistics.median(steps["torchrun"]),
                    # Time the hypervisor ran other guests on our cores, per run in launch order: a run
                    # that lost seconds here is slower for reasons neither launcher controls.
                    "steal_seconds_per_run": steal,
                    # The same ratio over the rounds none of whose runs lost a second to steal.
                    "ray_vs_torchrun_step_ratio_quiet_rounds": _quiet_median(ratios, steal),
                })
            if not (args.smoke or args.no_faults):
                result["recovery_seconds"] = b.kill_run("ray", "worker")
                print(f"ray worker kill: recovered in {result['recovery_seconds']:.1f}s", flush=True)
                result["recovery_seconds_torchrun"] = b.kill_run("torchrun", "worker")
                print(f"torchrun worker kill: recovered in {result['recovery_seconds_torchrun']:.1f}s", flush=True)
                result["node_loss_recovery_seconds"] = b.kill_run("ray", "node")
                print(f"ray node loss: recovered in {result['node_loss_recovery_seconds']:.1f}s", flush=True)
        finally:
            b.close()
    result.update({
        "targets": {"ray_vs_torchrun_step_ratio": "<= 1.05", "recovery_seconds": "<= 20",
                    "node_loss_recovery_seconds": "<= 30"},
        "knobs": {"head_nice": args.head_nice, "worker_nice": args.worker_nice,
                  "health_check_period_ms": b.cluster.health_check_period_ms,
                  "health_check_failure_threshold": b.cluster.health_check_failure_threshold,
                  "ray.worker_group_start_timeout_s (node loss run)": args.start_timeout},
        "steps": args.steps, "rounds": args.rounds, "smoke": args.smoke,
        "machine": describe(), "date": time.strftime("%Y-%m-%d"),
    })
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()
                      if not isinstance(v, dict)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
