"""The benchmarks keep working: each runs in its tiny smoke mode (numbers are not asserted).

Marker `bench`: `make bench-smoke` runs them (`pytest --bench`), and CI runs that after `make test`,
which leaves them out (about five minutes)."""

import json
import sys

import pytest
from helpers import REPO, run_cmd

from trainapp.core.amp import cpu_has_native_bf16

pytestmark = [pytest.mark.slow, pytest.mark.bench]


def smoke(name: str, tmp_path, *args: str, timeout: int = 300):
    """Run the benchmark bench.NAME in its smoke mode; (its result, the run). The run must succeed."""
    out = tmp_path / f"{name}.json"
    r = run_cmd([sys.executable, "-m", f"bench.{name}", "--smoke", *args, "--out", str(out)], timeout=timeout)
    assert r.returncode == 0, r.output[-4000:]
    return json.loads(out.read_text()), r


def test_loop_overhead_benchmark_smoke(tmp_path):
    result, r = smoke("loop_overhead", tmp_path)
    assert result["smoke"] is True and result["world_size"] == 2
    assert result["loop_overhead_ratio"] > 0 and result["control_ratio"] > 0
    assert len(result["trainapp_step_ms_rounds"]) == len(result["minimal_step_ms_rounds"]) == 1
    assert len(result["trainapp_novote_cpu_ms_rounds"]) == 1 and result["vote_cpu_ratio"] > 0
    # Emulated bf16 would time the emulation, not the loop: bf16 only where the CPU has it.
    assert result["amp"] == ("bf16" if cpu_has_native_bf16() else "fp32")
    assert "cores" in result["machine"]
    assert "loop_overhead_ratio=" in r.stdout


def test_launchers_benchmark_smoke(tmp_path):
    result, _ = smoke("launchers", tmp_path, timeout=600)
    assert result["smoke"] is True
    assert result["startup_seconds_ray"] > 0 and result["startup_seconds_torchrun"] > 0
    assert result["ray_vs_torchrun_step_ratio"] > 0
    assert len(result["steal_seconds_per_run"]) == 3  # torchrun, Ray, torchrun
    # The CPU sampler found both training workers under each launcher, and Ray's own processes.
    assert result["train_cores_ray"] > 0.5 and result["train_cores_torchrun"] > 0.5
    assert result["other_cores_ray"] > 0 and result["train_cpu_ms_per_step_ray"] > 0
    assert result["train_cpu_ratio_ray_vs_torchrun"] > 0 and result["train_faults_per_step_torchrun"] >= 0
    assert result["train_cpu_control_ratio"] > 0  # the CPU each worker measured itself, paired like steps
    # Ray's runtime threads in its workers (the core worker's task loop and its C++ threads) are found,
    # and torchrun's workers, which run training on their main thread, have next to none.
    assert result["runtime_main_thread_ms_per_s_ray"] > 0
    assert result["runtime_threads_ms_per_s_ray"] > result["runtime_threads_ms_per_s_torchrun"]
    # Where the start-up went, phase by phase, under each launcher (trainapp/observe/timeline.py marks).
    ray, torchrun = result["startup_breakdown_ray"], result["startup_breakdown_torchrun"]
    assert {"job submission", "preflight probes", "worker imports Ray Train, its context", "data and model",
            "first step"} <= ray.keys(), ray
    assert "job submission" not in torchrun, torchrun
    assert "process group (Ray: training's imports meanwhile; torchrun: and imports)" in torchrun, torchrun
    assert abs(sum(ray.values()) - result["startup_seconds_ray"]) < 0.5, (ray, result["startup_seconds_ray"])
    # One training worker of one thread under each launcher.
    assert result["ray_vs_torchrun_step_ratio_spare_core"] > 0 and result["train_cores_ray_spare_core"] < 1.2


def test_ray_floor_benchmark_smoke(tmp_path):
    result, _ = smoke("ray_floor", tmp_path, "--trainapp-variants", "ray,ray_every", timeout=600)
    assert result["smoke"] is True
    # trainapp under Ray twice a round: its defaults, and every snapshot registered with Ray.
    assert result["trainapp_variants"] == {"ray": [], "ray_every": ["ray.report_interval_s=0"]}
    assert result["trainapp_cpu_ratio_every"] > 0 and len(result["trainapp_cpu_ratio_every_per_round"]) == 1
    # The minimal loop ran where each launcher runs training: torchrun's main thread, a thread Ray
    # Train started; so the Ray runs did run inside Ray Train's workers.
    assert result["minimal_training_in_main_thread"] == {"torchrun": [True] * 2, "ray": [False] * 2,
                                                         "ray_report": [False] * 2}  # by rank
    for key in ("minimal_cpu_ratio", "minimal_cpu_ratio_report", "minimal_cpu_control_ratio",
                "minimal_thread_cpu_ratio", "trainapp_cpu_ratio", "trainapp_cpu_control_ratio"):
        assert result[key] > 0 and len(result[f"{key}_per_round"]) == 1, key
    # Each worker's process CPU covers its training thread and more (gloo's threads, and Ray's).
    for launcher in ("torchrun", "ray", "ray_report"):
        assert result[f"minimal_other_threads_ms_per_step_{launcher}"] > 0, launcher
    assert result["trainapp_vs_minimal_report_cpu_ratio"] > 0  # trainapp against Ray Train's floor
    # Only the reporting variant reports, and the time in its reports is measured.
    assert result["minimal_report_ms_ray_report"] > 0
    assert result["minimal_report_ms_ray"] == result["minimal_report_ms_torchrun"] == 0
    assert result["variants"] == {"ray": {"report_every": 0, "poll_s": None},
                                  "ray_report": {"report_every": 10, "poll_s": 0.25}}


def test_snapshot_cost_benchmark_smoke(tmp_path):
    result, _ = smoke("snapshot_cost", tmp_path, "--dir", str(tmp_path))
    assert result["smoke"] is True and result["async_vs_sync_blocking_ratio"] > 0
    assert result["blocking"]["resnet18"]["state_mb"] > 80  # weights + momentum of 11.7M parameters
    assert not [p for p in tmp_path.iterdir()
                if p.name.startswith("trainapp-snapcost-")], "left its snapshots"


def test_amp_cpu_benchmark_smoke_and_the_summary_table(tmp_path):
    result, _ = smoke("amp_cpu", tmp_path)
    assert result["bf16_vs_fp32_step_ratio"]["smallcnn"] > 0
    for name in ("loop_overhead", "launchers"):
        (tmp_path / f"{name}.json").write_text((REPO / "bench" / "results" / f"{name}.json").read_text())
    r = run_cmd([sys.executable, "-m", "bench.summary", "--results", str(tmp_path)], timeout=60)
    assert r.returncode == 0, r.output
    table = (tmp_path / "summary.md").read_text()
    assert "| `loop_overhead` |" in table and "| `amp_cpu` | smallcnn" in table
    assert "`snapshot_cost`" in table and "not run" in table  # a benchmark without results says so


def test_preempt_benchmark_smoke(tmp_path):
    result, r = smoke("preempt", tmp_path)
    assert result["smoke"] is True and len(result["runs"]) == 1
    run = result["runs"][0]
    assert 0 < run["preempt_seconds"] < 25 and run["stop_step"] >= 6 and run["snapshot_bytes"] > 0
    assert result["vote_cpu_ms"] > 0 and result["vote_wall_ms"] > 0 and result["vote_share"] > 0
    assert "preempt_seconds=" in r.stdout


def test_char_lm_benchmark_smoke(tmp_path):
    result, r = smoke("char_lm", tmp_path)
    assert result["smoke"] is True and result["steps"] == 20 and result["vocab"] == 82
    # the task's defaults
    assert 0 < result["val_loss_vs_uniform"] and result["config"]["optim"]["name"] == "adamw"
    assert "char_lm:" in r.stdout


def test_compile_benchmark_smoke(tmp_path):
    result, r = smoke("compile", tmp_path, timeout=600)
    assert result["smoke"] is True and len(result["rounds"]) == 1
    assert result["compile_step_ratio"] > 0 and result["control_ratio"] > 0
    assert all(result[k] > 0 for k in ("compile_resume_warm_s", "compile_resume_cold_s", "eager_resume_s"))
    assert 0 < result["ac_activation_ratio"] < 0.6 and result["compile_loss_rel_diff_max"] < 0.05
    assert "compile:" in r.stdout


def test_lightning_benchmark_smoke(tmp_path):
    result, r = smoke("lightning", tmp_path, timeout=600)
    assert result["smoke"] is True and len(result["rounds"]) == 1 and result["global_batch"] == 32
    assert all(result[f"{n}_step_ms"] > 0 and result[f"{n}_cpu_ms"] > 0
               for n in ("trainapp", "lightning", "compiled", "control"))
    assert "lightning:" in r.stdout


def test_hang_benchmark_smoke(tmp_path):
    # torchrun only: the Ray half starts a cluster of its own (a minute and a half), and the Ray hang
    # path is tested in test_ray.py.
    result, _ = smoke("hang", tmp_path, "--launchers", "torchrun")
    assert result["smoke"] is True and result["fault.hang_timeout_s"] == 5.0
    assert result["hang_recovery_seconds_torchrun"] > result["hang_detect_seconds_torchrun"] >= 5.0
    assert set(result["breakdown_seconds"]["torchrun"]) == {"detect", "restart", "resume"}


def test_ray_stop_benchmark_smoke(tmp_path):
    result, _ = smoke("ray_stop", tmp_path, timeout=600)
    assert result["smoke"] is True and result["redone_after_stop"] == 0
    assert result["fresh_s"] > 0 and result["after_stop_s"] > 0 and result["stop_to_end_s"] > 0


def test_resize_benchmark_smoke(tmp_path):
    """The math of a run resized 2 -> 1 -> 2 against a straight run, and the rescaling control: the
    figures are there and the control really rescaled (its global batch followed the world size)."""
    result, r = smoke("resize", tmp_path)
    assert result["smoke"] is True and result["cycles"] == []
    assert result["math_two_slots"]["keep"]["global_batches"] == [128, 128, 128]
    assert result["math_two_slots"]["rescale"]["global_batches"] == [128, 64, 128]
    assert result["resize_param_rel_distance"] < result["resize_param_rel_distance_rescale"]
    assert (tmp_path / "resize.png").stat().st_size > 10_000
    assert "resize_param_rel_distance=" in r.stdout


def test_fsdp_benchmark_smoke(tmp_path):
    """FSDP against DDP on the character transformer: each rank holds about half of what DDP's does
    (a ratio near 1 would mean nothing was sharded), both runs trained."""
    result, r = smoke("fsdp", tmp_path)
    assert result["smoke"] is True and len(result["rounds"]) == 1
    assert 0.4 < result["memory_ratio"] < 0.6, result["bytes_per_rank"]
    assert result["step_time_ratio"] > 0 and "memory_ratio=" in r.stdout


def test_export_benchmark_smoke(tmp_path):
    """`trainapp export` of a sharded and a whole snapshot, each in its own measured process: the FSDP run
    really left shards, every export passed its check (fp32 bitwise), the bf16 file is half the fp32 one,
    and the peak RSS above the baseline is at least most of the model (the export holds it; a ratio near
    0 would mean the measured process was not the export)."""
    result, r = smoke("export", tmp_path)
    variants = result["variants"]
    assert result["smoke"] is True and result["optimizer"] == "adamw"
    assert result["model_bytes"] == 5 * (1024 * 1024 + 1024) * 4  # WideMLP(width=1024, depth=5), fp32
    assert result["snapshot_bytes"]["fsdp"] > 2.5 * result["model_bytes"]  # the model and AdamW's two moments
    run = result["rounds"][0]
    assert {run[n]["source_kind"] for n in variants if n.startswith("sharded")} == {"sharded snapshot"}
    assert run["whole_fp32_check"]["source_kind"] == "snapshot"
    assert (variants["sharded_fp32_check"]["checks_passed"] == [True]
            and run["sharded_fp32_check"]["check_equal"])
    assert variants["whole_fp32_check"]["checks_passed"] == [True]
    assert variants["sharded_bf16_nocheck"]["checks_passed"] == [None]  # --no-check
    assert variants["sharded_bf16_nocheck"]["file_bytes"] < 0.6 * variants["sharded_fp32_check"]["file_bytes"]
    assert result["sharded_peak_ratio"] > 0.8 and result["whole_peak_ratio"] > 0.8, variants
    assert run["baseline_fsdp"]["peak_rss"] > 100 * 2**20  # a process that imported torch
    assert "sharded_peak_ratio=" in r.stdout


def test_tracking_benchmark_smoke(tmp_path):
    """A real MLflow server, one run per case: every logged step's value reached it (after the record was
    written), and the throughput rounds ran."""
    result, _ = smoke("tracking", tmp_path, timeout=600)
    (cadence, delay), = result["delay_by_snapshot_every"].items()
    assert result["smoke"] is True and not delay["unseen_steps"] and 0 < delay["median_s"] <= delay["max_s"]
    assert result["tracking_throughput_ratio"] > 0 and len(result["rounds"]) == 1


def test_stream_benchmark_smoke(tmp_path):
    result, _ = smoke("stream", tmp_path, timeout=600)
    assert result["resize"]["keep"]["param_rel_distance"] == 0.0, result["resize"]
    assert result["resize"]["rescale"]["data"]["resized"] == 2, result["resize"]
    assert set(result["throughput"]) == {"mlp32_workers0", "mlp32_workers1", "deep_workers0", "deep_workers1"}
    assert all("tensor_shards_over_map" in v for v in result["throughput"].values()), result["throughput"]


def test_memory_benchmark_smoke(tmp_path):
    result, _ = smoke("memory", tmp_path, "--launchers", "torchrun", timeout=900)
    runs = result["memory_runs_torchrun"] + result["storage_runs_torchrun"]
    assert [r["tier"] for r in runs] == ["memory", "storage"] and runs[0]["redone"] <= 1, runs
    assert result["memory_snapshot_step_ratio"] > 0 and result["memory_snapshot_step_ratio_char_lm"] > 0
