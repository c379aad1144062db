"""Streams (docs/your-own-model.md, "Streaming data"): how fast a stream of small items from local files
feeds training against a map-style list of the same items, and how far a resized stream run lands from
its straight twin.

Throughput: the sample-ledger model (tests/usertasks: an 8-feature MLP, so reading the data is most of a
step, the harshest case for a data path) on 8192 items of 8 floats, `train.batch_size=64`, fp32, one
process, 200 steps: the map-style task (the items in a Python list, read by index) and the streaming task
(the same items in 16 JSON Lines files, parsed as they are read), each with `data.num_workers=0` and 1;
rounds in alternating order, the ratio stream / map-style per round and pairing, then the median;
`control` is the map-style run against itself. samples/s is the training loop's (the run's end record).

Resize: the streaming task (8 equal shards, 2 micro-batches per step) trained 100 steps by 2 processes
straight, resized 2 -> 1 -> 2 with `train.on_resize=keep` (rank killed after the first snapshot, the lone
process after the second, as bench/resize.py does), and with `rescale` (the control: the lanes re-dealt);
the relative L2 distance of the final parameters to the straight run's, as bench/results/resize.json has
for map-style data.

    python -m bench.stream            # writes bench/results/stream.json
    python -m bench.stream --smoke    # one round, 30 steps
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from bench.common import BIN, REPO, records, result_path, write_result
from bench.machine import describe
from bench.resize import _run, final, rel_distance, resized
from bench.scratch import scratch

USERTASKS = REPO / "tests" / "usertasks"
os.environ["PYTHONPATH"] = os.pathsep.join([str(USERTASKS), os.environ["PYTHONPATH"]])
TASKS = {"map": ["task.name=usertasks_ledger:Ledger"],
         "stream": ["task.name=usertasks_stream:StreamLedger", "task.args.shards=16"]}


def samples_per_s(run_dir: Path) -> float:
    return next(r for r in records(run_dir) if r["kind"] == "end")["samples_per_s"]


def throughput(tmp: Path, rounds: int, steps: int) -> dict:
    common = [f"train.max_steps={steps}", "train.epochs=100", "train.batch_size=64", "amp.dtype=off",
              "train.progress=false", "train.log_every=50", "snapshot.every_steps=100000", "task.args.rows=8192",
              "task.args.record=false", "run.export=false"]
    out: dict = {}
    for workers in (0, 1):
        ratios, controls, speeds = [], [], {"map": [], "stream": []}
        for r in range(rounds):
            order = ["map", "stream", "map2"] if r % 2 == 0 else ["map2", "stream", "map"]
            got = {}
            for name in order:
                run = tmp / f"w{workers}-r{r}-{name}"
                _run([str(BIN / "python"), "-m", "trainapp", "train", f"run.dir={run}",
                      *TASKS[name.rstrip("2")], *common, f"data.num_workers={workers}"])
                got[name] = samples_per_s(run)
            ratios.append(got["stream"] / got["map"])
            controls.append(got["map2"] / got["map"])
            speeds["map"].append(got["map"])
            speeds["stream"].append(got["stream"])
            print(f"workers={workers} round {r}: map-style {got['map']:.0f}/s, stream {got['stream']:.0f}/s "
                  f"({ratios[-1]:.3f}x), control {controls[-1]:.3f}x", flush=True)
        out[f"workers{workers}"] = {"stream_over_map": statistics.median(ratios),
                                    "control": statistics.median(controls),
                                    "map_samples_per_s": statistics.median(speeds["map"]),
                                    "stream_samples_per_s": statistics.median(speeds["stream"]),
                                    "rounds": rounds}
    return out


def resize(tmp: Path, steps: int, every: int) -> dict:
    args = [*TASKS["stream"][:1], "task.args.record=false", f"train.max_steps={steps}", "train.epochs=100",
            f"snapshot.every_steps={every}", "train.batch_size=16", "train.grad_accum=1", "amp.dtype=off",
            "train.progress=false", "train.log_every=1"]
    runs = {name: tmp / f"resize-{name}" for name in ("straight", "keep", "rescale")}
    _run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "trainapp", "train",
          f"run.dir={runs['straight']}", *args])
    resized(runs["keep"], args, steps, every)
    resized(runs["rescale"], [*args, "train.on_resize=rescale"], steps, every)
    ref, ref_loss = final(runs["straight"])
    out: dict = {"final_loss_straight": ref_loss}
    for name in ("keep", "rescale"):
        params, loss = final(runs[name])
        end = next(r for r in records(runs[name]) if r["kind"] == "end")
        out[name] = {"param_rel_distance": rel_distance(params, ref), "final_loss": loss,
                     "final_loss_rel_diff": abs(loss - ref_loss) / ref_loss, "data": end.get("data"),
                     "global_batches": [r["global_batch"] for r in records(runs[name]) if r["kind"] == "start"]}
        print(f"resize {name}: parameters {out[name]['param_rel_distance']:.3g} from the straight run's, final "
              f"loss {loss:.5f} (straight {ref_loss:.5f})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    out = result_path("stream.json", args.smoke, args.out)
    with scratch("ta-bench-stream-") as tmp:
        result = {"machine": describe(), "smoke": args.smoke,
                  "throughput": throughput(Path(tmp), 1 if args.smoke else 3, 30 if args.smoke else 200),
                  "resize": resize(Path(tmp), 30 if args.smoke else 100, 10 if args.smoke else 33)}
    result["stream_over_map"] = result["throughput"]["workers0"]["stream_over_map"]
    result["resize_param_rel_distance"] = result["resize"]["keep"]["param_rel_distance"]
    result["resize_param_rel_distance_rescale"] = result["resize"]["rescale"]["param_rel_distance"]
    write_result(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
