"""`ray job stop`, then a resubmission: how soon the next run trains (docs/ray.md, "Stopping a run").

On a local multi-node Ray cluster (head + 2 worker nodes, 1 CPU each, on loopback), an elastic run
(`ray.num_workers=[1,2]`) per submission, each measured from `ray job submit` to the first optimizer
step (from the run's own metrics.jsonl), in rounds of three, side by side:

- fresh: a new `ray.name`, nothing stopped before it (the control);
- after a stop: `ray job stop` of that run mid-interval (with RAY_JOB_STOP_WAIT_TIME_S=60, as `make
  ray-submit` sets), then at once the same name again: it resumes at the stopped step;
- after a kill: the next run's driver SIGKILLed mid-run (a stop that ran out of Ray's wait, a crashed
  driver: its controller dies with the job and cancels nothing), then at once the same name again:
  the new driver cancels the request the killed controller left with Ray Data's autoscaling
  coordinator;
- the control of that (first round only, not in --smoke): the same kill, then a new name with the
  controller's note of its request removed first, as a driver without that release would find it: it
  waits for the request to expire (up to 180 s).

Also: seconds from `ray job stop` to the job's end, and the steps the resubmission redid (0 expected).

    python -m bench.ray_stop            # writes bench/results/ray_stop.json
    python -m bench.ray_stop --smoke    # one round, no kill case
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


from bench.common import REPO, first_step_start, overrides, records, result_path, wait_for
from bench.machine import describe
from bench.scratch import scratch

from devtools.local_ray import RAY, LocalCluster, free_port
from trainapp.launch.ray.stop import REQUESTS



class Stops:
    def __init__(self, args, storage: Path):
        self.args, self.storage = args, storage
        self.cluster = LocalCluster(Path(f"/tmp/ta-bench-{uuid.uuid4().hex[:6]}"), workers=2, cpus=1,
                                    gcs_port=free_port(), dashboard_port=free_port())

    def submit(self, name: str, sid: str, *extra: str) -> float:
        """`ray job submit --no-wait` of the elastic run NAME; the wall time it was submitted at."""
        wait = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})
        cmd = [RAY, "job", "submit", "--address", self.cluster.dashboard_url, "--submission-id", sid,
               "--no-wait", "--runtime-env-json", wait, "--", "python", "-m", "trainapp", "ray",
               f"ray.storage_path={self.storage}", f"ray.name={name}", "ray.num_workers=[1,2]",
               *overrides(self.args.steps, self.args.snapshot_every, "train.log_every=1", *extra)]
        t0 = time.time()
        subprocess.run(cmd, cwd=REPO, env=self.cluster.env(), check=True, capture_output=True, timeout=120)
        return t0

    def first_step(self, name: str, t0: float, attempt: int) -> float:
        """Seconds from `t0` to the first step of the run's `attempt`-th start (1: the first)."""
        run_dir = self.storage / name

        def started() -> bool:
            recs = records(run_dir)
            starts = [i for i, r in enumerate(recs) if r["kind"] == "start"]
            return len(starts) >= attempt and any(r["kind"] == "train" for r in recs[starts[attempt - 1]:])

        wait_for(started, 600, f"{name}'s first step")
        recs = records(run_dir)
        at = [i for i, r in enumerate(recs) if r["kind"] == "start"][attempt - 1]
        return first_step_start(recs[at:]) - t0

    def ray(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([RAY, "job", *args, "--address", self.cluster.dashboard_url], cwd=REPO,
                              env=self.cluster.env(), capture_output=True, text=True, timeout=300)

    def stop(self, name: str, sid: str) -> float:
        """`ray job stop` once the run passed the kill step; seconds until the job ended."""
        wait_for(lambda: any(r["kind"] == "train" and r["step"] >= self.args.kill_step
                             for r in records(self.storage / name)), 300,
                 f"{name} at step {self.args.kill_step}")
        t = time.monotonic()
        self.ray("stop", sid)
        return time.monotonic() - t

    def kill_driver(self, name: str) -> None:
        """SIGKILL the run's driver (the holder of its lease) once it passed the kill step."""
        run_dir = self.storage / name
        wait_for(lambda: any(r["kind"] == "train" and r["step"] >= self.args.kill_step
                             for r in records(run_dir)),
                 300, f"{name} at step {self.args.kill_step}")
        gens = sorted((run_dir / "lease").glob("gen-*.json"))
        os.kill(json.loads(gens[-1].read_text())["holder"]["pid"], signal.SIGKILL)

    def finish(self, name: str) -> int:
        """The steps the run redid over all its attempts, once its job has finished."""
        wait_for(lambda: any(r["kind"] == "end" for r in records(self.storage / name)), 600, f"{name}'s end")
        steps = [r["step"] for r in records(self.storage / name) if r["kind"] == "train"]
        return len(steps) - len(set(steps))

    def round(self, i: int, kill: bool) -> dict:
        out = {}
        name = f"fresh-{i}"
        t0 = self.submit(name, f"{name}-a", "drill.slow_rank=0", "drill.slow_ms=50")
        out["fresh_s"] = self.first_step(name, t0, 1)
        out["stop_to_end_s"] = self.stop(name, f"{name}-a")
        t0 = self.submit(name, f"{name}-b")
        out["after_stop_s"] = self.first_step(name, t0, 2)
        out["redone_after_stop"] = self.finish(name)
        if kill:
            name = f"killed-{i}"
            t0 = self.submit(name, f"{name}-a", "drill.slow_rank=0", "drill.slow_ms=50")
            out["fresh_2_s"] = self.first_step(name, t0, 1)
            self.kill_driver(name)
            time.sleep(1)  # Ray ends the dead driver's job
            t0 = self.submit(name, f"{name}-b")
            out["after_kill_s"] = self.first_step(name, t0, 2)
            self.finish(name)
        if kill and i == 0 and self.args.control:
            self.submit("ctl-a", "ctl-a", "drill.slow_rank=0", "drill.slow_ms=50")
            self.kill_driver("ctl-a")
            time.sleep(1)
            # what a driver without the release finds: nothing to cancel
            shutil.rmtree(self.storage / REQUESTS)
            t0 = self.submit("ctl-b", "ctl-b")
            out["control_after_kill_no_release_s"] = self.first_step("ctl-b", t0, 1)
            self.finish("ctl-b")
        print(json.dumps({"round": i, **{k: round(v, 2) for k, v in out.items()}}), flush=True)
        return out


def summarize(rounds: list[dict]) -> dict:
    def med(key: str) -> float | None:
        vals = [r[key] for r in rounds if key in r]
        return statistics.median(vals) if vals else None

    out = {k: med(k) for k in ("fresh_s", "after_stop_s", "stop_to_end_s", "fresh_2_s", "after_kill_s",
                               "control_after_kill_no_release_s")}
    out["after_stop_minus_fresh_s"] = statistics.median(r["after_stop_s"] - r["fresh_s"] for r in rounds)
    if out["after_kill_s"] is not None:
        out["after_kill_minus_fresh_s"] = statistics.median(
            r["after_kill_s"] - r["fresh_2_s"] for r in rounds)
    out["redone_after_stop"] = max(r["redone_after_stop"] for r in rounds)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one round, no kill case")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--snapshot-every", type=int, default=50)
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--no-control", dest="control", action="store_false",
                   help="leave out the control without the release (it waits up to 180 s)")
    p.add_argument("--out", help="result file (default bench/results/ray_stop.json)")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 120
    out = result_path("ray_stop.json", args.smoke, args.out)
    with scratch("ta-bench-") as tmp:
        s = Stops(args, Path(tmp) / "storage")
        try:
            s.cluster.up(cwd=REPO)
            rounds = [s.round(i, kill=not args.smoke) for i in range(args.rounds)]
        finally:
            s.cluster.down(grace=5)
            subprocess.run(["rm", "-rf", str(s.cluster.dir)], check=False)
    result = {**summarize(rounds), "rounds": rounds, "smoke": args.smoke, "machine": describe(),
              "date": time.strftime("%Y-%m-%d")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(" ".join(f"{k}={v:.2f}" for k, v in result.items() if isinstance(v, float)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
