"""Streams (docs/your-own-model.md, "Streaming data"): how fast a stream of small items from local files
feeds training against a map-style list of the same items, and how far a resized stream run lands from
its straight twin.

Throughput: the sample-ledger model (tests/usertasks: an 8-feature MLP, hidden width 32, so reading the
data is most of a step, the harshest case for a data path; and "deep": two more 1024 x 1024 layers, about
4 MFLOP an item, where computing is most of a step) on 8192 items of 8 floats, `train.batch_size=64`,
fp32, one process, 1500 steps (500 for "deep"): the map-style task (the items as tensors in a Python list,
read by index), the streaming task (the same items in 16 JSON Lines files, parsed as they are read), the
same items in 16 tensor shards (`trainapp.streams.write_tensor_shards`: read as slices, no decoding) and,
as the control for the work of decoding, a map-style dataset of the same JSON lines decoded as each is
read; `data.num_workers=0` and 1 (one loader worker beside the training process). Rounds in alternating
order; each ratio is taken within a round, then the median; `control` is the map-style run against
itself. samples/s is the training loop's (the run's end record).

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
import time
from pathlib import Path

from bench.common import BIN, REPO, records, result_path, write_result
from bench.machine import describe
from bench.resize import _run, final, rel_distance, resized
from bench.scratch import scratch

USERTASKS = REPO / "tests" / "usertasks"
os.environ["PYTHONPATH"] = os.pathsep.join([str(USERTASKS), os.environ["PYTHONPATH"]])


def samples_per_s(run_dir: Path) -> float:
    return next(r for r in records(run_dir) if r["kind"] == "end")["samples_per_s"]


CONTESTANTS = {
    "map": ["task.name=usertasks_ledger:Ledger"],
    "stream": ["task.name=usertasks_stream:StreamLedger", "task.args.shards=16"],
    "tensors": ["task.name=usertasks_stream:StreamLedger", "task.args.shards=16", "task.args.fmt=tensors"],
    "lines": ["task.name=usertasks_stream:StreamLedger", "task.args.shards=16", "task.args.map_style=true"],
}


def throughput(tmp: Path, rounds: int, steps: int) -> dict:
    """Per setting, rounds of (map-style, JSON Lines stream, tensor shards, map-style decoding the JSON lines,
    map-style again) in alternating orders: each ratio to the round's first map-style run, then the median
    over rounds."""
    common = ["train.epochs=100", "train.batch_size=64", "amp.dtype=off",
              "train.progress=false", "train.log_every=50", "snapshot.every_steps=100000",
              "task.args.rows=8192", "task.args.record=false", "run.export=false"]
    deep = ["task.args.hidden=1024", "task.args.depth=2"]
    settings = {"mlp32_workers0": ["data.num_workers=0"], "mlp32_workers1": ["data.num_workers=1"],
                "deep_workers0": ["data.num_workers=0", *deep],
                "deep_workers1": ["data.num_workers=1", *deep]}
    out: dict = {}
    for setting, extra in settings.items():
        got: dict[str, list[float]] = {"map": [], "stream": [], "tensors": [], "lines": [], "map2": []}
        for r in range(rounds):
            order = ["map", "stream", "tensors", "lines", "map2"]
            for name in order if r % 2 == 0 else order[::-1]:
                run = tmp / f"{setting}-r{r}-{name}"
                n = steps // 3 if setting.startswith("deep") else steps  # about as long as the others
                _run([str(BIN / "python"), "-m", "trainapp", "train", f"run.dir={run}",
                      f"train.max_steps={n}",
                      *CONTESTANTS[name.rstrip("2")], *common, *extra])
                got[name].append(samples_per_s(run))
            line = ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in got.items())
            print(f"{setting} round {r}: {line}", flush=True)

        def ratio(name: str) -> float:
            return statistics.median(a / b for a, b in zip(got[name], got["map"]))

        out[setting] = {"stream_over_map": ratio("stream"), "tensor_shards_over_map": ratio("tensors"),
                        "stream_over_decoding_map": statistics.median(
                            a / b for a, b in zip(got["stream"], got["lines"])),
                        "decoding_map_over_map": ratio("lines"), "control": ratio("map2"),
                        "samples_per_s": {k: statistics.median(v) for k, v in got.items()}, "rounds": rounds}
    return out


def resize(tmp: Path, steps: int, every: int) -> dict:
    args = [*CONTESTANTS["stream"][:1], "task.args.record=false", f"train.max_steps={steps}",
            "train.epochs=100",
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
                     "global_batches": [r["global_batch"] for r in records(runs[name])
                                        if r["kind"] == "start"]}
        print(f"resize {name}: parameters {out[name]['param_rel_distance']:.3g} from the straight run's, "
              f"final loss {loss:.5f} (straight {ref_loss:.5f})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    out = result_path("stream.json", args.smoke, args.out)
    with scratch("ta-bench-stream-") as tmp:
        result = {"machine": describe(), "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke,
                  "throughput": throughput(Path(tmp), 1 if args.smoke else 3, 30 if args.smoke else 1500),
                  "resize": resize(Path(tmp), 30 if args.smoke else 100, 10 if args.smoke else 33)}
    result["stream_over_map"] = result["throughput"]["mlp32_workers0"]["stream_over_map"]
    result["stream_over_decoding_map"] = result["throughput"]["mlp32_workers0"]["stream_over_decoding_map"]
    result["stream_over_map_deep"] = result["throughput"]["deep_workers0"]["stream_over_map"]
    result["stream_over_map_deep_workers1"] = result["throughput"]["deep_workers1"]["stream_over_map"]
    result["stream_tensor_shards_over_map"] = result["throughput"]["mlp32_workers0"]["tensor_shards_over_map"]
    result["stream_tensor_shards_over_map_workers1"] = \
        result["throughput"]["mlp32_workers1"]["tensor_shards_over_map"]
    result["stream_control"] = result["throughput"]["mlp32_workers0"]["control"]
    result["resize_param_rel_distance"] = result["resize"]["keep"]["param_rel_distance"]
    result["resize_param_rel_distance_rescale"] = result["resize"]["rescale"]["param_rel_distance"]
    write_result(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
