"""One table of every benchmark's headline numbers, from bench/results/*.json.

    python -m bench.summary                  # prints it and writes bench/results/summary.md
    python -m bench.summary --results DIR    # another results folder (e.g. bench/results/smoke)

A row per headline metric: the value, its target where the issue set one, whether it is met, and when
and on which CPU it was measured (the CPU of the project's machine type changes between sessions).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (file, metric key, label, target as (op, bound) or None, format)
ROWS = [
    ("loop_overhead", "loop_overhead_ratio", "trainapp loop / minimal DDP loop, step time", ("<=", 1.03),
     "{:.3f}"),
    ("loop_overhead", "control_ratio", "minimal loop / itself (noise floor)", None, "{:.3f}"),
    ("loop_overhead", "vote_cost_ratio", "trainapp / trainapp without the preemption vote, step time "
     "(noise-bound)", None, "{:.3f}"),
    ("loop_overhead", "ranks_cost_ratio", "trainapp / trainapp without per-rank phase timings, step time "
     "(noise-bound)", None, "{:.3f}"),
    ("launchers", "ray_vs_torchrun_step_ratio_spare_core", "Ray Train / torchrun, step time, 1 worker of 1 "
     "thread, the other core left to the daemons", ("<=", 1.02), "{:.3f}"),
    ("launchers", "control_ratio_spare_core", "torchrun / torchrun, the same (noise floor)", None, "{:.3f}"),
    ("launchers", "train_cpu_ratio_ray_vs_torchrun", "Ray Train / torchrun, CPU per step of a training "
     "worker", ("<=", 1.02), "{:.3f}"),
    ("launchers", "train_cpu_control_ratio", "torchrun / torchrun, the same (noise floor)", None, "{:.3f}"),
    ("ray_floor", "minimal_cpu_ratio", "a minimal DDP loop in a bare TorchTrainer / under torchrun, CPU per "
     "step (what Ray Train costs any loop)", None, "{:.3f}"),
    ("ray_floor", "minimal_cpu_ratio_report", "the same with a `ray.train.report` every 10 steps and "
     "controller polls every 0.25 s, as trainapp's runs before `ray.report_interval_s`", None, "{:.3f}"),
    ("ray_floor", "minimal_cpu_control_ratio", "torchrun / torchrun, the same (noise floor)", None, "{:.3f}"),
    ("ray_floor", "trainapp_cpu_ratio", "trainapp under Ray Train / torchrun, CPU per step, the same rounds",
     None, "{:.3f}"),
    ("launchers", "runtime_threads_ms_per_s_ray", "Ray: CPU of Ray's own threads in each training worker "
     "(ms/s)", None, "{:.1f}"),
    ("launchers", "ray_vs_torchrun_step_ratio", "Ray Train / torchrun, step time, 2 workers sharing 2 cores "
     "with Ray's daemons", None, "{:.3f}"),
    ("launchers", "control_ratio", "torchrun / torchrun, the same (noise floor)", None, "{:.3f}"),
    ("launchers", "other_cores_ray", "Ray: cores used by everything but training during a job", None,
     "{:.2f}"),
    ("launchers", "other_cores_torchrun", "torchrun: the same (torchrun's agent and the idle Ray cluster)",
     None, "{:.2f}"),
    ("launchers", "startup_seconds_torchrun", "torchrun: launch to first step (s)", None, "{:.1f}"),
    ("launchers", "startup_seconds_ray", "Ray: `ray job submit` to first step (s)", ("<=", 15), "{:.1f}"),
    ("launchers", "recovery_seconds", "Ray: worker SIGKILL to first resumed step (s)", ("<=", 8), "{:.1f}"),
    ("launchers", "recovery_seconds_torchrun", "torchrun: worker SIGKILL to first resumed step (s)", None,
     "{:.1f}"),
    ("launchers", "node_loss_recovery_seconds", "Ray elastic: node lost to first step on the rest (s)",
     ("<=", 10), "{:.1f}"),
    ("ray_stop", "after_stop_minus_fresh_s", "Ray: submit to first step of an elastic resubmission after "
     "`ray job stop`, minus a fresh submit's (s)", ("<=", 5), "{:.1f}"),
    ("ray_stop", "after_kill_minus_fresh_s", "the same after the driver was SIGKILLed (its resource request "
     "left behind) (s)", ("<=", 5), "{:.1f}"),
    ("ray_stop", "control_after_kill_no_release_s", "control: a new elastic run after that kill, the request "
     "not released, submit to first step (s)", None, "{:.1f}"),
    ("ray_stop", "stop_to_end_s", "Ray: `ray job stop` to the job's end, the stop snapshot registered (s)",
     None, "{:.1f}"),
    ("resize", "resize_param_rel_distance", "elastic: a run resized 2 -> 1 -> 2 (global batch kept), final "
     "parameters' relative distance to a straight run's, SmallCNN fp32, 100 steps", ("<=", 1e-4), "{:.2g}"),
    ("resize", "resize_param_rel_distance_rescale", "control: the same resizes with the LR rescaled instead "
     "(the rule before)", None, "{:.2g}"),
    ("resize", "resize_param_rel_distance_4slots", "the same with the global batch in 4 micro-batches (the "
     "float sums added in another order after a resize)", None, "{:.2g}"),
    ("resize", "float_order_floor_4slots", "its floor: a straight run on one process, the same math, the "
     "sums in another order", None, "{:.2g}"),
    ("resize", "resize_param_rel_distance_4slots_rescale", "its control: the resizes with the LR rescaled",
     None, "{:.2g}"),
    ("memory", "memory_over_storage_loss_torchrun", "memory tier: time a SIGKILLed worker costs (to the "
     "first resumed step, plus the steps redone), with it / without (storage every 50 steps), torchrun x2, "
     "SmallCNN at batch 256", ("<=", 0.5), "{:.3f}"),
    ("memory", "memory_recovery_seconds_torchrun", "memory tier: that time with it, torchrun (s)", None,
     "{:.1f}"),
    ("memory", "storage_recovery_seconds_torchrun", "control: without it (storage resumes), torchrun (s)",
     None, "{:.1f}"),
    ("memory", "memory_over_storage_loss", "the same under Ray Train, the restart in spare processes",
     ("<=", 0.5), "{:.3f}"),
    ("memory", "memory_recovery_seconds", "memory tier: that time with it, Ray Train, spares (s)", None,
     "{:.1f}"),
    ("memory", "memory_recovery_seconds_no_spares", "the same without spare processes, Ray Train (s)", None,
     "{:.1f}"),
    ("memory", "memory_over_storage_loss_no_spares", "memory tier alone, with / without, Ray Train", None,
     "{:.3f}"),
    ("memory", "storage_recovery_seconds", "control: neither, Ray Train (s)", None, "{:.1f}"),
    ("memory", "memory_snapshot_step_ratio", "memory tier: step time with a copy every step / without, "
     "SmallCNN, torchrun x2", ("<=", 1.03), "{:.3f}"),
    ("memory", "memory_snapshot_step_ratio_control", "control: without / without", None, "{:.3f}"),
    ("memory", "memory_snapshot_step_ratio_char_lm", "the same, char_lm", ("<=", 1.03), "{:.3f}"),
    ("stream", "stream_tensor_shards_over_map", "streams: training samples/s, 16 tensor shards / the same "
     "items as tensors in a list, 8-feature MLP (data-bound), 1 process", (">=", 0.95), "{:.3f}"),
    ("stream", "stream_control", "control: the list / the list again (run-to-run spread)", None, "{:.3f}"),
    ("stream", "stream_tensor_shards_over_map_workers1", "the same with one loader worker", (">=", 0.95),
     "{:.3f}"),
    ("stream", "stream_over_map", "16 JSON Lines shards (each line decoded when read) / the list", None,
     "{:.3f}"),
    ("stream", "stream_over_decoding_map", "control: the stream / a map-style list of the same JSON lines, "
     "each decoded when read (the same work per item)", None, "{:.3f}"),
    ("stream", "stream_over_map_deep_workers1", "the stream / the list, a model with 4 MFLOP an item, one "
     "loader worker", None, "{:.3f}"),
    ("stream", "resize_param_rel_distance", "a stream run resized 2 -> 1 -> 2 (global batch kept), final "
     "parameters' relative distance to the straight run's", None, "{:.2g}"),
    ("stream", "resize_param_rel_distance_rescale", "control: the same resizes with "
     "`train.on_resize=rescale` (the lanes re-dealt)", None, "{:.2g}"),
    ("ray_versions", "startup_s_oldest", "Ray 2.55 (oldest supported): `ray job submit` to first step (s)",
     None, "{:.1f}"),
    ("ray_versions", "startup_s_newest", "Ray 2.60 (newest): the same, alternating rounds (s)", None,
     "{:.1f}"),
    ("ray_versions", "node_lost_to_one_worker_s_oldest", "Ray 2.55: elastic, node lost to first step on the "
     "rest, the cluster re-read by the coordinator's tick (s)", ("<=", 10), "{:.1f}"),
    ("ray_versions", "node_lost_to_one_worker_s_newest", "Ray 2.60: the same, re-read by `recompute=True` "
     "(s)", None, "{:.1f}"),
    ("fsdp", "memory_ratio", "FSDP / DDP, parameters + gradients + AdamW state per rank, char_lm, 2 ranks",
     ("<=", 0.55), "{:.3f}"),
    ("fsdp", "step_time_ratio", "FSDP / DDP, step time, the same runs on CPU (for information)", None,
     "{:.3f}"),
    ("resize", "grow_back_seconds", "Ray elastic: a lost node back (`ray start`) to the first step on two "
     "workers (s)", ("<=", 30), "{:.1f}"),
    ("snapshot_cost", "async_vs_sync_blocking_ratio", "snapshot blocking time, async / sync (worse model)",
     ("<=", 0.25), "{:.3f}"),
    ("snapshot_cost", "throughput_loss_at_100_steps", "throughput lost to one async snapshot per 100 steps",
     ("<=", 0.01), "{:.2%}"),
    ("snapshot_cost", "throughput_loss_at_100_steps_spare_core", "the same, training leaving one core free",
     None, "{:.2%}"),
    ("preempt", "preempt_seconds", "SIGTERM to the snapshot of the step reached, resnet18, torchrun x2 (s)",
     ("<=", 25), "{:.2f}"),
    ("preempt", "periodic_snapshot_seconds", "a periodic snapshot of the same state (s)", None, "{:.2f}"),
    ("preempt", "vote_cpu_ms", "one preemption vote, measured alone: CPU (ms)", None, "{:.3f}"),
    ("preempt", "vote_share", "votes' share of the CPU at one vote per 0.5 s", None, "{:.3%}"),
    ("hang", "hang_detect_seconds_torchrun", "torchrun: a rank hangs to the first watchdog firing (s)",
     None, "{:.1f}"),
    ("hang", "hang_recovery_seconds_torchrun", "torchrun: a rank hangs to the first resumed step (s)",
     ("<=", 100), "{:.1f}"),
    ("hang", "hang_detect_seconds_ray", "Ray: a rank hangs to the first watchdog firing (s)", None, "{:.1f}"),
    ("hang", "hang_recovery_seconds_ray", "Ray: a rank hangs to the first resumed step (s)", ("<=", 100),
     "{:.1f}"),
    ("char_lm", "wall_seconds", "`make run ARGS=task.name=char_lm`, command to exit, torchrun x2 (s)", None,
     "{:.0f}"),
    ("char_lm", "val_loss_vs_uniform", "char_lm's final val_loss / the uniform guess's log(vocab)",
     ("<=", 0.6), "{:.3f}"),
    ("export", "sharded_peak_ratio", "`trainapp export` of a sharded (FSDP) snapshot, a 288 MiB MLP, fp32 "
     "with the check: peak RSS above a process that reads no weights / the model's bytes", ("<=", 1.5),
     "{:.2f}"),
    ("export", "whole_peak_ratio", "the same of a whole (DDP) snapshot (its mapped `state.pt` pages count)",
     None, "{:.2f}"),
    ("export", "sharded_export_s", "the sharded export's time, fp32 with the check, 2 cores (s)", None,
     "{:.1f}"),
    ("compile", "compile_warm_minus_eager_resume_s", "compiled char_lm resumed on an empty local inductor "
     "cache with the carried cache: first step after the start, minus an eager resume's (s)", ("<=", 5),
     "{:.1f}"),
    ("compile", "compile_resume_cold_s", "the same resume without the carried cache: first step after the "
     "start (s)", None, "{:.1f}"),
    ("compile", "eager_resume_s", "an eager resume: first step after the start (s)", None, "{:.1f}"),
    ("compile", "compile_step_ratio", "compiled / eager step time, char_lm 4x256 alone, 2 threads", None,
     "{:.3f}"),
    ("compile", "control_ratio", "eager / eager, the same rounds (noise floor)", None, "{:.3f}"),
    ("compile", "ac_activation_ratio", "activation checkpointing (`full`) / none: the bytes a training "
     "forward keeps for the backward, char_lm 4x256 at 512-character blocks", ("<=", 0.6), "{:.3f}"),
    ("compile", "ac_step_ratio", "activation checkpointing / none, step time", None, "{:.3f}"),
    ("lightning", "trainapp_vs_lightning_step_ratio", "trainapp / Lightning's Trainer, step time, the same "
     "char_lm, data, batch and optimizer, DDP x2", ("<=", 1.0), "{:.3f}"),
    ("lightning", "control_ratio", "trainapp / trainapp, the same rounds (noise floor)", None, "{:.3f}"),
    ("lightning", "compiled_vs_lightning_step_ratio", "trainapp compiled / Lightning, step time", None,
     "{:.3f}"),
    ("lightning", "trainapp_vs_lightning_cpu_ratio", "trainapp / Lightning, CPU per step of rank 0", None,
     "{:.3f}"),
    ("lightning", "cpu_control_ratio", "trainapp / trainapp, the same (noise floor)", None, "{:.3f}"),
    ("tracking", "delay_median_s", "a step's value reaching a real MLflow server, torchrun x2, log_every=1, "
     "snapshot.every_steps=5: median (s)", None, "{:.2f}"),
    ("tracking", "delay_p90_s", "the same, 90th percentile (s)", None, "{:.2f}"),
    ("tracking", "delay_median_s_every_20", "the same at snapshot.every_steps=20: median (s)", None,
     "{:.2f}"),
    ("tracking", "tracking_throughput_ratio", "training samples/s with MLflow tracking / without", None,
     "{:.3f}"),
    ("tracking", "control_ratio", "without / without, the same rounds (noise floor)", None, "{:.3f}"),
    ("tracking", "tracking_cpu_ratio", "rank 0's process CPU per step with tracking / without (the sender's "
     "own cost)", None, "{:.3f}"),
    ("tracking", "cpu_control_ratio", "the same, without / without (noise floor)", None, "{:.3f}"),
]


def _value(results: dict, name: str, key: str):
    data = results.get(name)
    return None if data is None else data.get(key)


def cpu(machine: str) -> str:
    """A short name for the CPU of `bench/machine.py`'s description ("EPYC AVX2", "Xeon AMX")."""
    vendor = "EPYC" if "EPYC" in machine else "Xeon" if "Xeon" in machine else "CPU"
    feature = ("AMX" if "amx_bf16" in machine else "AVX-512 BF16" if "avx512_bf16" in machine
               else "AVX-512" if "avx512f" in machine else "AVX2" if "avx2" in machine else "")
    return f"{vendor} {feature}".strip()


def _when(data: dict | None) -> str:
    return f"{data.get('date', '')[5:]}, {cpu(data.get('machine', ''))}" if data else ""


def table(results_dir: Path) -> str:
    results = {p.stem: json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json"))}
    lines = ["| benchmark | metric | value | target | met | measured |", "|---|---|---|---|---|---|"]
    for name, key, label, target, fmt in ROWS:
        value = _value(results, name, key)
        shown = fmt.format(value) if isinstance(value, (int, float)) else "not run"
        if target and isinstance(value, (int, float)):
            op, bound = target
            met = "yes" if (value <= bound if op == "<=" else value >= bound) else "**no**"
            goal = f"{op} {fmt.format(bound)}"
        else:
            met, goal = "", ""
        lines.append(f"| `{name}` | {label} (`{key}`) | {shown} | {goal} | {met} | "
                     f"{_when(results.get(name))} |")
    amp = results.get("amp_cpu", {}).get("models", {})
    for model, m in amp.items():
        lines.append(f"| `amp_cpu` | {model}: bf16 autocast / fp32, step time ({m['bf16_step_ms']:.1f} vs "
                     f"{m['fp32_step_ms']:.1f} ms) | {m['bf16_vs_fp32_step_ratio']:.3f} |  |  | "
                     f"{_when(results.get('amp_cpu'))} |")
    torch = sorted({r["machine"].rsplit("torch ", 1)[-1] for r in results.values()
                    if "torch " in r.get("machine", "")})
    return "\n".join(lines) + f"\n\nMeasured on x86_64, 2 cores, 24 GiB, no GPU; torch {', '.join(torch)}.\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=HERE / "results")
    args = p.parse_args()
    if not args.results.is_dir():
        print(f"summary: error: --results {args.results}: no such directory; run `make bench` first",
              file=sys.stderr)
        return 2
    text = table(args.results)
    (args.results / "summary.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
