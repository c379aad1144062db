"""The supported Ray versions side by side (docs/ray.md, "Ray versions"): the newest and the oldest of
trainapp/launch/ray/checks.py's range, each in its own environment (the oldest's: `make test-ray-oldest`
makes .venv-ray-oldest), in alternating rounds of one run each on a local multi-node Ray cluster (head +
2 worker nodes, 1 CPU each, on loopback; bench/resize.py's `GrowBack`):

- startup: `ray job submit` to the first step's record;
- node loss: a worker node's raylet SIGKILLed, to the first step on the one worker left (an elastic run,
  `ray.num_workers=[1,2]`): this is where the oldest Ray's fallback for the cluster re-read (the
  coordinator's tick instead of `recompute=True`) would cost seconds if it cost any;
- grow-back: `ray start` of a node again, to the first step on two workers.

    python -m bench.ray_versions                 # writes bench/results/ray_versions.json
    python -m bench.ray_versions --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from bench.common import REPO, result_path
from bench.machine import describe

KEYS = ("startup_s", "node_lost_to_one_worker_s", "grow_back_seconds")


def child(storage: Path) -> None:
    """In the Ray to measure: one run, one lost-and-back cycle; one JSON line."""
    import ray
    from resize import GrowBack

    g = GrowBack(storage)
    cycle = g.measure(1)[0]
    print(json.dumps({"ray": ray.__version__, "startup_s": g.startup_s, **cycle}), flush=True)


def run(python: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="ta-bench-rayv-") as tmp:
        r = subprocess.run([python, "-m", "bench.ray_versions", "--child", tmp], cwd=REPO,
                           capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"bench/ray_versions.py: the run with {python} failed:\n"
                         f"{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Medians per Ray, nested and flat (`startup_s_oldest`, ...: bench/summary.py's rows)."""
    out = {which: {"ray": rs[0]["ray"], **{k: statistics.median(r[k] for r in rs) for k in KEYS}}
           for which, rs in runs.items()}
    out.update({f"{k}_{which}": out[which][k] for which in runs for k in KEYS})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds of (oldest, newest) runs")
    p.add_argument("--oldest-python", default=str(REPO / ".venv-ray-oldest" / "bin" / "python"),
                   help="a python whose Ray is the oldest supported (make test-ray-oldest makes it)")
    p.add_argument("--child", metavar="STORAGE", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(result_path("ray_versions.json", False)))
    args = p.parse_args()
    if args.child:
        child(Path(args.child))
        return 0
    if not Path(args.oldest_python).exists():
        raise SystemExit(f"--oldest-python={args.oldest_python}: no such python; "
                         f"`make test-ray-oldest` makes it")
    runs: dict[str, list[dict]] = {"oldest": [], "newest": []}
    for i in range(args.rounds):
        for which, python in (("oldest", args.oldest_python), ("newest", sys.executable)):
            runs[which].append(run(python))
            print(f"round {i} {which}: " + json.dumps({k: round(runs[which][-1][k], 1) for k in KEYS}),
                  flush=True)
    result = {**summarize(runs), "runs": runs, "machine": describe(), "date": time.strftime("%Y-%m-%d")}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({w: result[w] for w in ("oldest", "newest")}), f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
