"""The memory tier (docs/how-it-works.md#the-memory-tier): the time a lost worker costs with it and without
it, and what its copies cost the steps.

- Time lost per failure: a 2-worker run of the built-in SmallCNN (`train.batch_size=256`: about 100 ms a
  step on these 2 cores), storage snapshots every 50 steps, one training worker SIGKILLed at a seeded
  random step from 60 to 99; the same kill steps with the memory tier on (a copy every step) and off
  (the control: storage resumes it, as before the tier). Lost = (the first step after the restart -
  the kill) + the steps redone x the run's median step time. Under torchrun (its agent restarts the
  group) and under Ray Train on a local cluster (head + 2 worker nodes, 1 CPU each), where the memory
  tier's runs have spare worker processes (`ray.spare_after_s=0`, the kill waits until both are idle)
  and a third run of each kill step has the memory tier without them. Keys `memory_recovery_seconds`
  (Ray), `memory_recovery_seconds_torchrun`, their controls `storage_recovery_seconds(_torchrun)`,
  `memory_over_storage_loss(_torchrun)`, and under Ray `..._no_spares`; also the steps redone and the
  tier each restart says.
- Step cost: paired runs under torchrun (2 workers), memory tier on (a copy every step) and off, in
  alternating order, each a median step time over its log intervals (samples/s counts the copies);
  `memory_snapshot_step_ratio` (SmallCNN), `memory_snapshot_step_ratio_char_lm`, and `control` (off/off);
  also each model's copy time in the run (`MODEL_copy_ms`, the end record's `memory_tier.copy_ms`) and its
  share of a step without copies (`MODEL_copy_share`), which the machine's drift between runs leaves alone.

    python -m bench.memory            # writes bench/results/memory.json
    python -m bench.memory --smoke    # one round of each, short runs
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import REPO, launch_cmd, memory_tier_keys, overrides, records, result_path, write_result
from bench.launchers import Bench, step_times
from bench.launchers import parser as launchers_parser
from bench.machine import describe
from bench.scratch import scratch

SMALLCNN = ["train.batch_size=128"]
FAULT_MODEL = ["train.batch_size=256"]
"""The fault runs' SmallCNN: about 100 ms a step on these 2 cores."""
CHAR_LM = ["task.name=char_lm", "task.args.n_embd=64", "task.args.n_layer=2", "task.args.block_size=64",
           "train.batch_size=32"]


MODES = ("memory", "storage", "memory_no_spares")
"""The fault runs: the memory tier with spare processes (Ray: docs/ray.md#spare-workers), the storage tier
alone as before both (the control), and under Ray the memory tier without spares."""


def _memory(on: bool, memory_dir: Path) -> list[str]:
    return (["snapshot.memory_every_steps=1", f"snapshot.memory_dir={memory_dir}"] if on
            else ["snapshot.memory_every_steps=0"])


def _fault(launcher: str, mode: str, memory_dir: Path) -> list[str]:
    """A fault run's settings: the tier, and under Ray the spares (started at once, where the default waits
    30 s: the kill then waits for both)."""
    spares = [] if launcher != "ray" else ["ray.spare_workers=false"]
    if launcher == "ray" and mode == "memory":
        spares = ["ray.spare_workers=true", "ray.spare_after_s=0"]
    return [*_memory(mode != "storage", memory_dir), *spares]


def lost(run_dir: Path, to_step: float) -> dict:
    """What the kill cost the run: `to_step` seconds to the first step after the restart, the steps redone,
    the median step time, and their sum (the steps redone at that time)."""
    recs = records(run_dir)
    starts = [i for i, r in enumerate(recs) if r["kind"] == "start"]
    before = max(r["step"] for r in recs[starts[0]:starts[1]] if r["kind"] == "train")
    restart = recs[starts[1]]
    step_s = statistics.median(step_times(recs))
    redone = max(0, before - (restart.get("resumed_step") or 0))
    return {"to_first_step_s": to_step, "redone": redone, "step_s": step_s,
            "lost_s": to_step + redone * step_s, "tier": restart.get("resumed_tier"),
            "resumed_step": restart.get("resumed_step"), "killed_after": before}


def _fault_run(b: Bench, work: Path, launcher: str, mode: str, i: int, kill: int) -> dict:
    """One kill run of `mode` (MODES), what it lost and where the restart's seconds went."""
    name = f"{launcher}-{mode}-{i}"
    memory_dir = Path(tempfile.mkdtemp(prefix="ta-bench-mem-", dir="/dev/shm"))
    spare = mode == "memory" and launcher == "ray"
    try:
        seconds, phases = b.kill_run(launcher, "worker", i, "worker2", *FAULT_MODEL,
                                     *_fault(launcher, mode, memory_dir), kill_step=kill, name=name,
                                     ready=(lambda: len(b.cluster.spare_pids()) == 2) if spare else None)
    finally:
        shutil.rmtree(memory_dir, ignore_errors=True)
    r = {**lost(work / name, seconds), "phases": phases}
    print(f"{launcher} {mode} killed after step {r['killed_after']}: resumed {r['resumed_step']} "
          f"({r['tier']}), {r['redone']} redone, lost {r['lost_s']:.1f} s "
          f"({r['to_first_step_s']:.1f} s to a step)", flush=True)
    return r


def fault_rounds(work: Path, launchers: list[str], rounds: int, steps: int, seed: int) -> dict:
    """Per launcher, `rounds` kill steps (seeded), each a worker SIGKILLed in each of MODES (torchrun: the
    first two), each mode first in turn (bench/launchers.py's kill runs, storage snapshots every 50 steps)."""
    rng = random.Random(seed)
    kills = [rng.randrange(60, 100) for _ in range(rounds)]
    out: dict = {"kill_steps": kills}
    b = Bench(launchers_parser().parse_args(["--steps", str(steps), "--snapshot-every", "50"]), work)
    try:
        if "ray" in launchers:
            b.cluster.up(cwd=REPO)
        for launcher in launchers:
            modes = MODES if launcher == "ray" else MODES[:2]
            got: dict[str, list[dict]] = {mode: [] for mode in modes}
            for i, k in enumerate(kills):
                for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
                    got[mode].append(_fault_run(b, work, launcher, mode, i, k))
            suffix = "" if launcher == "ray" else "_torchrun"
            for mode in modes:
                tier, also = ("storage", "") if mode == "storage" else ("memory", mode.removeprefix("memory"))
                lost_s = [r["lost_s"] for r in got[mode]]
                out[f"{tier}_recovery_seconds{suffix}{also}"] = statistics.median(lost_s)
                out[f"{tier}_runs{suffix}{also}"] = got[mode]
                if mode != "storage":
                    out[f"memory_over_storage_loss{suffix}{also}"] = statistics.median(
                        m["lost_s"] / s["lost_s"] for m, s in zip(got[mode], got["storage"]))
    finally:
        b.close()
    return out


def step_rounds(work: Path, rounds: int, steps: int) -> dict:
    """Paired torchrun runs, memory tier on (every step) and off, SmallCNN and char_lm: step-time ratios."""
    out: dict = {}
    for model, extra in (("smallcnn", SMALLCNN), ("char_lm", CHAR_LM)):
        got: dict[str, list[float]] = {"on": [], "off": [], "off2": []}
        copy_ms: list[float] = []
        for r in range(rounds):
            order = ["off", "on", "off2"] if r % 2 == 0 else ["off2", "on", "off"]
            for mode in order:
                run_dir = work / f"steps-{model}-{mode}-{r}"
                memory_dir = Path(tempfile.mkdtemp(prefix="ta-bench-mem-", dir="/dev/shm"))
                try:
                    args = overrides(steps, 100000, *extra, "train.log_every=10",
                                     *_memory(mode == "on", memory_dir))
                    cmd, env = launch_cmd("torchrun", run_dir, args, None, max_failures=0)
                    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, timeout=900)
                finally:
                    shutil.rmtree(memory_dir, ignore_errors=True)
                recs = records(run_dir)
                got[mode].append(statistics.median(step_times(recs)))
                if mode == "on":  # the copy's own time, from the end record
                    copy_ms += [ms for r in recs if r["kind"] == "end"
                                and (ms := (r.get("memory_tier") or {}).get("copy_ms"))][-1:]
            print(f"{model} round {r}: " + ", ".join(f"{k} {1e3 * v[-1]:.1f} ms" for k, v in got.items()),
                  flush=True)
        key = "memory_snapshot_step_ratio" + ("" if model == "smallcnn" else f"_{model}")
        out[key] = statistics.median(a / b for a, b in zip(got["on"], got["off"]))
        out[f"{key}_control"] = statistics.median(a / b for a, b in zip(got["off2"], got["off"]))
        out[f"{model}_step_ms"] = {k: 1e3 * statistics.median(v) for k, v in got.items()}
        if copy_ms:  # the copy's own time in the run (its end record), against the step: drift-free
            out[f"{model}_copy_ms"] = statistics.median(copy_ms)
            out[f"{model}_copy_share"] = statistics.median(copy_ms) / out[f"{model}_step_ms"]["off"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--launchers", default="torchrun,ray", help="the launchers of the fault runs ('': none)")
    args = ap.parse_args()
    out = result_path("memory.json", args.smoke, args.out)
    with scratch("ta-bench-memory-") as tmp:
        result = {"machine": describe(), "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke}
        result.update(step_rounds(Path(tmp), 1 if args.smoke else 3, 40 if args.smoke else 150))
        launchers = [name for name in args.launchers.split(",") if name]
        if launchers:
            result.update(fault_rounds(Path(tmp), launchers, 1 if args.smoke else 3, 110, seed=0))
    result["targets"] = {"memory_over_storage_loss": "<= 0.5", "memory_over_storage_loss_torchrun": "<= 0.5",
                         "memory_snapshot_step_ratio": "<= 1.03",
                         "memory_snapshot_step_ratio_char_lm": "<= 1.03"}
    write_result(out, result)
    print(f"wrote {out}")
    if launchers and not args.smoke and args.out is None:  # beside the launchers' own recovery times
        beside = result_path("launchers.json", False)
        if beside.exists():
            write_result(beside, {**json.loads(beside.read_text()), **memory_tier_keys(result, out)})
            print(f"and its time per failure into {beside}")


if __name__ == "__main__":
    main()
