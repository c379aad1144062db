"""Hang detection and recovery: a hung rank to the job training again, under torchrun and Ray Train.

Measured at the watchdog's default `fault.hang_timeout_s` (60 s), under torchrun and under Ray Train
on a local multi-node Ray cluster. Each round runs one job per launcher, 2 workers each (`torchrun
--standalone --nproc_per_node=2 --max-restarts=1`; Ray Train with `ray.max_failures=1` on a head + 2
worker nodes of 1 CPU each, submitted with `ray job submit`): SmallCNN, a snapshot every 10 steps, a
metrics record every step, and the drill `drill.hang_at_step=15 drill.rank=1`: rank 1's training
thread sleeps for good after step 15 (as a stuck data loader would), having written the time into the
drill's marker file; rank 0 blocks in the next all-reduce, so both stop beating. Measured from the
files the run leaves (wall-clock times, one machine):
- `hang_detect_seconds_*`: the marker's time to the first watchdog firing (a `failure` record with
  cause "hang" where the loop writes one, else the earliest `run.dir/hangs/*.txt` mtime: the watchdog
  writes it, then exits);
- `hang_recovery_seconds_*`: the marker's time to the first optimizer step of the restarted attempt
  (its first `train` record, as `bench/launchers.py` times recovery after a kill);
- the breakdown of the recovery: detect; restart (the firing to the new attempt's `start` record: the
  launcher seeing the exit, ending the rest of the group, starting a new one, the snapshot loaded);
  resume (that `start` record to the first step done).
Medians over `--rounds` rounds, with every round's values. A round that did not resume from a snapshot
(a second `start` record with `resumed_step` > 0) or did not finish (an `end` record at
`train.max_steps`) fails the benchmark.

    python -m bench.hang            # 3 rounds per launcher (about 10 min), writes bench/results/hang.json
    python -m bench.hang --smoke    # one round per launcher at fault.hang_timeout_s=5 (about 100 s, most
                                    # of it Ray's cluster and job startup); writes bench/results/smoke/
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
import uuid
from pathlib import Path

from bench.common import REPO, first_step_after_restart, launch_cmd, overrides, records, result_path
from bench.machine import describe
from bench.scratch import scratch

from trainapp.config import FaultSection

from trainapp.faults import drain
from devtools.local_ray import LocalCluster, free_port

LAUNCHERS = ("torchrun", "ray")


def config(args) -> list[str]:
    """Overrides shared by both launchers (the model and data are launchers.py's)."""
    out = overrides(args.steps, args.snapshot_every, "train.log_every=1",
                    f"drill.hang_at_step={args.hang_step}", f"drill.rank={args.rank}")
    if args.hang_timeout is not None:  # else trainapp's default: what is measured
        out.append(f"fault.hang_timeout_s={args.hang_timeout:g}")
    return out


def launch(launcher: str, run_dir: Path, args, cluster: LocalCluster | None, log: Path) -> subprocess.Popen:
    cmd, env = launch_cmd(launcher, run_dir, config(args), cluster, max_failures=1)
    if launcher == "torchrun":
        env[drain.RUNTIME_ENV] = str(runtime_dir(run_dir))
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def runtime_dir(run_dir: Path) -> Path:
    return run_dir.parent / f"{run_dir.name}-rt"


def stop(p: subprocess.Popen, run_dir: Path) -> None:
    """End exactly this run's processes: the launcher's session and torchrun's registered workers
    (they sit in process groups of their own)."""
    for pid in drain.registered(runtime_dir(run_dir)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def firings(run_dir: Path, recs: list[dict]) -> list[dict]:
    """Every watchdog firing of the run, earliest first: `failure` records with cause "hang" where there
    are any (their `time`), else the stack files in run.dir/hangs (their mtime)."""
    failed = [{"time": r["time"], "rank": r.get("rank"), "source": "failure record"}
              for r in recs if r["kind"] == "failure" and r.get("cause") == "hang"]
    if failed:
        return sorted(failed, key=lambda f: f["time"])
    files = sorted((run_dir / "hangs").glob("rank-*-attempt-*.txt")) if (run_dir / "hangs").is_dir() else []
    return sorted(({"time": f.stat().st_mtime, "rank": int(f.name.split("-")[1]), "source": f.name}
                   for f in files), key=lambda f: f["time"])


def measure(launcher: str, run_dir: Path, args, code: int | None, log: Path) -> dict:
    """The round's times from its files; SystemExit naming what is missing when it did not hang, resume
    and finish as it must."""
    def fail(why: str) -> SystemExit:
        tail = "".join(log.read_text(errors="replace").splitlines(True)[-40:]) if log.exists() else ""
        ended = f"timed out after {args.run_timeout:g} s" if code is None else f"exit code {code}"
        return SystemExit(f"hang bench: {launcher} run {run_dir.name} ({ended}): {why}\n"
                          f"--- the launcher's last lines:\n{tail}")

    recs = records(run_dir)
    marker = run_dir / f"fault-fired-hang-step{args.hang_step}-rank{args.rank}"
    if not marker.exists():
        raise fail(f"the drill never fired (no {marker.name})")
    t_hang = float(marker.read_text().split()[0])
    fired = firings(run_dir, recs)
    if not fired:
        raise fail(f"no watchdog fired (nothing in {run_dir / 'hangs'}, no failure record)")
    starts = [r for r in recs if r["kind"] == "start"]
    if len(starts) < 2 or not starts[1].get("resumed_step"):
        resumed = [s.get("resumed_step") for s in starts]
        raise fail(f"did not resume from a snapshot: start records' resumed_step {resumed}")
    ends = [r for r in recs if r["kind"] == "end"]
    if code != 0 or not ends or ends[-1]["steps"] != args.steps:
        raise fail(f"did not finish: end records' steps {[e['steps'] for e in ends]}, "
                   f"train.max_steps={args.steps}")
    t_first = first_step_after_restart(run_dir)
    if t_first is None:
        raise fail("no step after the restart")
    t_detect, t_start = fired[0]["time"], starts[1]["time"]
    return {"hang_detect_seconds": t_detect - t_hang, "hang_recovery_seconds": t_first - t_hang,
            "breakdown": {"detect": t_detect - t_hang, "restart": t_start - t_detect,
                          "resume": t_first - t_start},
            "resumed_step": starts[1]["resumed_step"],
            "firings": [{**f, "after_hang_s": round(f["time"] - t_hang, 2)} for f in fired],
            "exit_code": code}


def one_round(launcher: str, run_dir: Path, args, cluster: LocalCluster | None) -> dict:
    log = run_dir.parent / f"{run_dir.name}.log"
    t0 = time.monotonic()
    p = launch(launcher, run_dir, args, cluster, log)
    try:
        code = p.wait(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        stop(p, run_dir)
    r = measure(launcher, run_dir, args, code, log)
    r["wall_seconds"] = time.monotonic() - t0
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true",
                   help="one round per launcher at fault.hang_timeout_s=5: only checks the benchmark works")
    p.add_argument("--rounds", type=int, default=3, help="rounds of one torchrun and one Ray job")
    p.add_argument("--launchers", nargs="+", choices=LAUNCHERS, default=list(LAUNCHERS))
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="fault.hang_timeout_s (default: trainapp's, 60 s; 5 with --smoke)")
    p.add_argument("--steps", type=int, default=40, help="train.max_steps")
    p.add_argument("--snapshot-every", type=int, default=10)
    p.add_argument("--hang-step", type=int, default=15,
                   help="drill.hang_at_step: after a snapshot, before the next")
    p.add_argument("--rank", type=int, default=1, help="drill.rank: the rank that hangs")
    p.add_argument("--run-timeout", type=float, default=600, help="seconds one job may take")
    p.add_argument("--out", help="result file (default bench/results/hang.json)")
    args = p.parse_args()
    if args.smoke:
        args.rounds = 1
        args.hang_timeout = 5.0 if args.hang_timeout is None else args.hang_timeout
    out = result_path("hang.json", args.smoke, args.out)
    rounds: dict[str, list[dict]] = {name: [] for name in args.launchers}
    cluster = None
    with scratch("ta-bench-hang-") as tmp:
        try:
            if "ray" in args.launchers:
                cluster = LocalCluster(Path(f"/tmp/ta-bench-{uuid.uuid4().hex[:6]}"), workers=2, cpus=1,
                                       gcs_port=free_port(), dashboard_port=free_port())
                t = time.time()
                cluster.up(cwd=REPO)
                print(f"cluster up in {time.time() - t:.1f}s", flush=True)
            for i in range(args.rounds):
                for launcher in args.launchers:
                    r = one_round(launcher, Path(tmp) / f"{launcher}-{i}", args, cluster)
                    rounds[launcher].append(r)
                    b = r["breakdown"]
                    fired = ", ".join(f"rank {f['rank']} +{f['after_hang_s']}s" for f in r["firings"])
                    print(f"{launcher} round {i}: detected {b['detect']:.1f}s, "
                          f"restarted {b['restart']:.1f}s, resumed {b['resume']:.1f}s -> training again "
                          f"{r['hang_recovery_seconds']:.1f}s after the hang (from step {r['resumed_step']}; "
                          f"watchdogs fired: {fired})", flush=True)
        finally:
            if cluster is not None:
                cluster.down()
                subprocess.run(["rm", "-rf", str(cluster.dir)], check=False)

    result: dict = {}
    for launcher, rs in rounds.items():
        result[f"hang_detect_seconds_{launcher}"] = statistics.median(r["hang_detect_seconds"] for r in rs)
        result[f"hang_recovery_seconds_{launcher}"] = statistics.median(
            r["hang_recovery_seconds"] for r in rs)
    result.update({
        # Medians of each part over the rounds (they need not add up to the median recovery).
        "breakdown_seconds": {launcher: {part: statistics.median(r["breakdown"][part] for r in rs)
                                         for part in ("detect", "restart", "resume")}
                              for launcher, rs in rounds.items()},
        "rounds": rounds,
        "target": {"hang_recovery_seconds": "<= 100 at fault.hang_timeout_s=60"},
        "fault.hang_timeout_s": (FaultSection().hang_timeout_s if args.hang_timeout is None
                                 else args.hang_timeout),
        "drill.hang_at_step": args.hang_step, "drill.rank": args.rank,
        "snapshot.every_steps": args.snapshot_every,
        "train.max_steps": args.steps, "world_size": 2, "smoke": args.smoke,
        "machine": describe(), "date": time.strftime("%Y-%m-%d"),
    })
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(" ".join(f"{k}={v:.1f}" for k, v in result.items() if isinstance(v, float)) + f" -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
