"""The built-in language model as a new user meets it: `make run ARGS="task.name=char_lm"`, timed.

One real `torchrun --standalone --nproc_per_node=2 -m trainapp train task.name=char_lm` with the task's
defaults (the command `make run` runs), on this machine's two cores. Recorded: the wall time from the
command to its exit (`wall_seconds`, the issue's "about a minute"), the steps and samples/s, and how
much it learned: the final `val_loss` (nats per character) and `val_bpc` against the uniform guess over
the text's characters, log(vocabulary) (`val_loss_vs_uniform`: the share of the uniform loss left).

    python -m bench.char_lm            # writes bench/results/char_lm.json
    python -m bench.char_lm --smoke    # 20 steps; for CI, writes bench/results/smoke/
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, result_path
from bench.machine import describe
from bench.scratch import scratch


from trainapp.observe.metrics import read
from trainapp.tasks.char_lm import read_text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="20 steps: only checks that the benchmark works")
    p.add_argument("--out", help="result file (default bench/results/char_lm.json)")
    args = p.parse_args()
    out = result_path("char_lm.json", args.smoke, args.out)
    vocab = len(set(read_text(None)))
    with scratch("ta-bench-charlm-") as tmp:
        run_dir = Path(tmp) / "run"
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        cmd = [torchrun, "--standalone", "--nproc_per_node=2", "-m", "trainapp", "train",
               f"run.dir={run_dir}", "task.name=char_lm", "train.progress=false",
               *(["train.max_steps=20"] if args.smoke else [])]
        t0 = time.monotonic()
        r = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                           text=True)
        wall = time.monotonic() - t0
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            return r.returncode
        (end,) = read(run_dir, "end")
        start = read(run_dir, "start")[0]
        final = read(run_dir, "eval")[-1]
    uniform = math.log(vocab)
    result = {
        "wall_seconds": round(wall, 1), "steps": end["steps"], "samples_per_s": end["samples_per_s"],
        "val_loss": final["val_loss"], "val_bpc": final["val_bpc"], "uniform_loss": uniform,
        "uniform_bpc": uniform / math.log(2), "val_loss_vs_uniform": final["val_loss"] / uniform,
        "vocab": vocab, "tokens_per_eval": final["val_count"], "world_size": end["world_size"],
        "amp": start.get("amp"),
        "config": {k: start["config"][k] for k in ("task", "optim", "sched", "train")},
        "machine": describe(), "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke, "target": "about 60 s",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"char_lm: {result['wall_seconds']} s for {result['steps']} steps, "
          f"val_loss {result['val_loss']:.3f} ({result['val_bpc']:.2f} bits/char) "
          f"against {uniform:.3f} uniform -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
