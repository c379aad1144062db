"""Experiment tracking: how long a step's value takes to reach MLflow, and what tracking costs training.

A real MLflow tracking server (SQLite backend) on 127.0.0.1; 2 ranks under torchrun, `train.log_every=1`.
The tracker takes a value once a snapshot covering its step is published (trainapp/observe/tracking/),
so its delay is set by `snapshot.every_steps`: measured at two cadences, by polling the server's REST
API every 0.2 s and noting when each step's `loss` first shows; the delay is that moment less the
`train` record's time. Beside it the bound the design gives: a snapshot interval of steps plus the
sender's poll. The cost: rounds with tracking on and off alternate (plus off against off, the noise
floor), compared by the training throughput of each run's `end` record, and by rank 0's process CPU per
step (every thread: the sender's own cost, without the server's, which shares this machine; importing
MLflow's client, about 3 s of CPU, falls in the first steps).

    python -m bench.tracking            # writes bench/results/tracking.json
    python -m bench.tracking --smoke    # one short round per case, bench/results/smoke/
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from bench.common import BIN, launch_cmd, overrides, records, result_path, write_result
from bench.machine import describe
from bench.scratch import scratch


def _server(root: Path) -> tuple[subprocess.Popen, str]:
    from devtools.local_ray import free_port

    port = free_port()
    proc = subprocess.Popen([str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
                             "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], stdout=open(root / "server.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            # No job runner: its huey store, a /dev/shm folder, outlives the server.
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"the MLflow server did not answer: {(root / 'server.log').read_text()[-2000:]}")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def _watch(url: str, run_dir: Path, seen: dict[int, float], stop: threading.Event) -> None:
    """Notes when each step's `loss` first shows in the server."""
    run_id = None
    while not stop.is_set():
        try:
            if run_id is None:
                run_id = json.loads((run_dir / "tracking.json").read_text())["mlflow"]["run_id"]
            hist = _get(f"{url}/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key=loss")
            now = time.time()
            for m in hist.get("metrics", []):
                seen.setdefault(int(m.get("step", 0)), now)
        except (OSError, KeyError, ValueError):
            pass
        stop.wait(0.2)


def one_run(tmp: Path, name: str, args: list[str], url: str | None, watch: bool = False) -> dict:
    """One torchrun run, tracked to `url` if given; `watch`: note when each step shows in the server (the
    polling loads the server, which shares this machine: only for the delay runs)."""
    run_dir = tmp / name
    extra = [f"observe.mlflow_uri={url}", "observe.mlflow_experiment=bench"] if url else []
    cmd, env = launch_cmd("torchrun", run_dir, [*args, *extra], None, 0)
    seen: dict[int, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(url, run_dir, seen, stop), daemon=True) if watch else None
    if watcher:
        watcher.start()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: exit {done.returncode}: {done.stderr[-3000:]}")
    if watcher:
        time.sleep(1.0)  # the watcher's last poll
        stop.set()
        watcher.join()
    recs = records(run_dir)
    train = {r["step"]: r["time"] for r in recs if r["kind"] == "train"}
    end = next(r for r in recs if r["kind"] == "end")
    steps = sorted(train)
    step_s = (train[steps[-1]] - train[steps[0]]) / max(len(steps) - 1, 1)
    delays = [seen[s] - train[s] for s in steps if s in seen]
    # Rank 0's process CPU per step (every thread, the sender's included), from its `ranks` records.
    cpu = statistics.median(r["ranks"][0]["cpu_ms"] for r in recs if r["kind"] == "ranks")
    return {"samples_per_s": end["samples_per_s"], "rank0_cpu_ms": cpu, "step_s": step_s, "delays": delays,
            "unseen": [s for s in steps if watch and s not in seen]}


def flat(delay: dict) -> dict:
    """The summary's keys: the delay at the first (short) cadence, and the median at the second."""
    (first, a), *rest = delay.items()
    out = {"delay_median_s": a["median_s"], "delay_p90_s": a["p90_s"], "delay_max_s": a["max_s"],
           "delay_cadence_steps": int(first)}
    if rest:
        out[f"delay_median_s_every_{rest[0][0]}"] = rest[0][1]["median_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    steps, rounds = (16, 1) if args.smoke else (200, 3)
    cadences = (4,) if args.smoke else (5, 20)
    out = result_path("tracking.json", args.smoke, args.out)
    base = overrides(steps, 5, "train.log_every=1")
    with scratch("bench-tracking-") as tmp_s:
        tmp = Path(tmp_s)
        server, url = _server(tmp)
        try:
            delay = {}
            for every in cadences:
                r = one_run(tmp, f"delay-{every}", overrides(steps, every, "train.log_every=1"), url,
                            watch=True)
                d = sorted(r["delays"])
                delay[str(every)] = {"median_s": statistics.median(d), "p90_s": d[int(0.9 * (len(d) - 1))],
                                     "max_s": d[-1], "step_s": r["step_s"], "unseen_steps": r["unseen"],
                                     "bound_s": every * r["step_s"] + 2.0}
                print(f"tracking: snapshot.every_steps={every}: delay median {statistics.median(d):.2f} s, "
                      f"max {d[-1]:.2f} s (step {r['step_s'] * 1000:.0f} ms)", flush=True)
            per_round = []
            for i in range(rounds):
                row = {}
                for case in ("on", "off", "off-control"):
                    run = one_run(tmp, f"{case}-{i}", base, url if case == "on" else None)
                    row[case], row[f"{case}_cpu"] = run["samples_per_s"], run["rank0_cpu_ms"]
                per_round.append(row)
                print(f"tracking: round {i + 1}/{rounds}: {row}", flush=True)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
    result = {
        **flat(delay),
        "delay_by_snapshot_every": delay,
        "tracking_throughput_ratio": statistics.median(r["on"] / r["off"] for r in per_round),
        "control_ratio": statistics.median(r["off-control"] / r["off"] for r in per_round),
        "tracking_cpu_ratio": statistics.median(r["on_cpu"] / r["off_cpu"] for r in per_round),
        "cpu_control_ratio": statistics.median(r["off-control_cpu"] / r["off_cpu"] for r in per_round),
        "rounds": per_round, "steps": steps, "machine": describe(), "date": time.strftime("%Y-%m-%d"),
        "smoke": args.smoke,
        "what": "2 ranks under torchrun, SmallCNN, log_every=1; an MLflow server (SQLite) on 127.0.0.1",
    }
    write_result(out, result)
    print(f"tracking: throughput with tracking {result['tracking_throughput_ratio']:.3f}x without (control "
          f"{result['control_ratio']:.3f}), rank 0 CPU per step {result['tracking_cpu_ratio']:.3f}x (control "
          f"{result['cpu_control_ratio']:.3f}) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
