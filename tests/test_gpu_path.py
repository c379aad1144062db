"""The GPU path, checked where a CPU can check it (issue: the GPU path made right before it first runs).

What needs a GPU's answers (is CUDA usable, how many devices, the compute capability, CUDA's generator)
comes from a stand-in here, and only that: the rules that read them, the refusals and their lines, the
side groups and the snapshots are the real ones. `make gpu-check` runs the rest on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess

import helpers
import pytest
import torch

from trainapp.config import ConfigError, TrainSection
from trainapp.core import kernels, parallel
from trainapp.core.amp import cuda_auto
from trainapp.core.layout import Layout
from trainapp.core.state import own_cuda_state, rng_state, set_rng_state
from trainapp.launch import device, net
from helpers import free_port
from trainapp.launch.ray.driver import gpus_for_workers
from trainapp.tasks.image import SmallCNN

CUDA0, CUDA3 = torch.device("cuda", 0), torch.device("cuda", 3)


def _seen(available: bool, count: int, **env: str) -> device.Visible:
    return device.Visible(available, count, env, "" if available else "torch 2.x is built for CUDA 13.0; "
                          "no NVIDIA driver loaded (no /proc/driver/nvidia/version)")


# --- dist.device ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting, seen, local_rank, local_world, expected", [
    ("auto", _seen(False, 0), 0, 2, torch.device("cpu")),
    # Ray's worker without GPUs
    ("auto", _seen(False, 0, CUDA_VISIBLE_DEVICES=""), 0, 2, torch.device("cpu")),
    ("auto", _seen(False, 0, CUDA_VISIBLE_DEVICES="-1"), 0, 1, torch.device("cpu")),
    ("auto", _seen(False, 0, SLURM_GPUS_ON_NODE="0"), 0, 1, torch.device("cpu")),
    ("cpu", _seen(True, 8, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"), 1, 8, torch.device("cpu")),
    ("auto", _seen(True, 8), 5, 8, torch.device("cuda", 5)),
    ("cuda", _seen(True, 4), 3, 4, CUDA3),
    ("cuda", _seen(True, 1, CUDA_VISIBLE_DEVICES="GPU-6f1d"), 3, 4, CUDA0),  # each rank shown its own GPU
])
def test_the_device_follows_dist_device_and_what_the_launcher_gave(setting, seen, local_rank, local_world,
                                                                   expected):
    chosen, why = device.choose(setting, seen, local_rank, local_world)
    assert chosen == expected and why.startswith(f"dist.device={setting}")


@pytest.mark.parametrize("setting, seen, local_world, needles", [
    ("cuda", _seen(False, 0), 1, ["dist.device=cuda:", "CUDA is not usable", "built for CUDA 13.0",
                                  "no NVIDIA driver"]),
    # GPUs allotted by the launcher but unusable: no silent fallback to the CPU and Gloo.
    ("auto", _seen(False, 0, CUDA_VISIBLE_DEVICES="0,1"), 2, ["dist.device=auto (CUDA_VISIBLE_DEVICES=0,1)",
                                                               "dist.device=cpu"]),
    ("auto", _seen(False, 0, SLURM_GPUS_ON_NODE="4"), 4, ["(SLURM_GPUS_ON_NODE=4)", "CUDA is not usable"]),
    ("cuda", _seen(False, 0, CUDA_VISIBLE_DEVICES=""), 1, ["CUDA_VISIBLE_DEVICES='' hides every GPU"]),
    ("cuda", _seen(True, 2), 4, ["4 ranks on this node but 2 GPU(s)", "--nproc-per-node=2"]),
    # no CUDA_VISIBLE_DEVICES: one GPU shared
    ("auto", _seen(True, 1), 2, ["2 ranks on this node but 1 GPU(s)"]),
])
def test_a_misconfigured_gpu_node_is_refused_with_one_line(setting, seen, local_world, needles):
    with pytest.raises(ConfigError) as e:
        device.choose(setting, seen, 0, local_world)
    line = str(e.value)
    assert "\n" not in line and all(n in line for n in needles), line


def test_under_ray_the_device_is_the_one_ray_gave():
    seen = _seen(True, 2, CUDA_VISIBLE_DEVICES="2,3")
    assert device.choose("auto", seen, 0, 1, lambda: torch.device("cuda", 1))[0] == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="Ray gave this worker no GPU; set ray.use_gpu=true"):
        device.choose("cuda", _seen(True, 1), 0, 1, lambda: torch.device("cpu"))


def test_the_driver_turns_dist_device_into_ray_use_gpu(tmp_path):
    from trainapp import config

    def cfg(*args):
        return config.load(None, [f"run.dir={tmp_path}", *args])

    assert gpus_for_workers(cfg(), 0) is False and gpus_for_workers(cfg(), 8) is True
    # the capacity check then names the missing GPUs
    assert gpus_for_workers(cfg("dist.device=cuda"), 0) is True
    assert gpus_for_workers(cfg("dist.device=cpu"), 8) is False
    with pytest.raises(ConfigError, match=r"dist.device=cuda with ray.use_gpu=false: .*set ray.use_gpu=true"):
        gpus_for_workers(cfg("dist.device=cuda", "ray.use_gpu=false"), 8)


def test_dist_device_cuda_without_cuda_stops_before_any_group_with_one_line(tmp_path):
    # This machine has no GPU: dist.device=cuda is the run a node with a too-old driver would start.
    r = helpers.trainapp("train", f"run.dir={tmp_path}", "dist.device=cuda", "train.max_steps=1", timeout=120)
    line = helpers.one_error_line(r, "train", "dist.device=cuda: CUDA is not usable in this process")
    assert f"torch {torch.__version__}" in line and not (tmp_path / "metrics.jsonl").exists()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}  # a launcher's GPU, on a node that cannot use it
    r = helpers.trainapp("train", f"run.dir={tmp_path}", "train.max_steps=1", timeout=120, env=env)
    helpers.one_error_line(r, "train", "dist.device=auto (CUDA_VISIBLE_DEVICES=0)")


# --- amp.dtype=auto on GPUs ----------------------------------------------------------------------------

@pytest.mark.parametrize("capability, name, expected", [
    ((7, 0), "Tesla V100", torch.float16), ((7, 5), "Tesla T4", torch.float16),
    ((8, 0), "A100", torch.bfloat16), ((8, 6), "RTX A6000", torch.bfloat16), ((9, 0), "H100", torch.bfloat16),
])
def test_auto_is_bf16_only_on_gpus_with_bf16_tensor_cores(capability, name, expected):
    # torch 2.14's is_bf16_supported() says yes on a T4 (it counts emulation): the rule reads the capability.
    dtype, why = cuda_auto(capability, name)
    assert dtype is expected and name in why and f"{capability[0]}.{capability[1]}" in why
    assert ("loss scaling" in why) is (expected is torch.float16)


# --- SyncBatchNorm and the split ------------------------------------------------------------------------

def _layout(world: int, global_batch: int, samples: int = 4096) -> Layout:
    return Layout(TrainSection(batch_size=8, global_batch=global_batch), world, 0, samples)


def test_syncbatchnorm_with_an_uneven_split_is_refused_on_every_device():
    plain, synced = SmallCNN(10), torch.nn.SyncBatchNorm.convert_sync_batchnorm(SmallCNN(10))
    parallel.check_sync_bn(synced, _layout(2, 32), requested=False)  # 4 slots over 2 ranks: even
    parallel.check_sync_bn(plain, _layout(2, 24), requested=False)  # uneven, but nothing synchronises
    parallel.check_sync_bn(synced, _layout(1, 24), requested=True)  # alone: no collective
    with pytest.raises(ConfigError) as e:
        parallel.check_sync_bn(plain, _layout(2, 24), requested=True)  # on CPU the image task keeps BatchNorm
    assert str(e.value).startswith("model.sync_bn=true: the global batch 24 is 3 micro-batches of 8")
    assert "set train.global_batch to a multiple of 16, or model.sync_bn=false" in str(e.value)
    # a user's own model
    with pytest.raises(ConfigError, match=r"the model.s SyncBatchNorm layers \(features.0.1, ...\)"):
        parallel.check_sync_bn(synced, _layout(2, 24), requested=False)
    resumed = _layout(3, 32)  # a run of global batch 32 resumed on 3 ranks: 4 slots over 3
    resumed.resume(32, 2)
    with pytest.raises(ConfigError, match=r"resumed at world size 3 from 2, train.on_resize=keep"):
        parallel.check_sync_bn(synced, resumed, requested=True)


def test_sync_bn_with_an_uneven_split_stops_a_cpu_run_before_training(tmp_path):
    r = helpers.torchrun(2, f"run.dir={tmp_path}", "model.sync_bn=true", "train.batch_size=16",
                         "train.global_batch=48", "train.max_steps=2", *helpers.QUICK, timeout=180)
    # torchrun reports its failed child with a traceback of its own; trainapp's is one line, the same from
    # every rank that printed it before torchrun stopped the others.
    lines = sorted({line for line in r.output.splitlines() if line.startswith("trainapp train: error:")})
    assert (len(lines) == 1
            and "model.sync_bn=true: the global batch 48 is 3 micro-batches of 16" in lines[0]), r.output
    assert "over 2 ranks" in lines[0] and "exitcode  : 2" in r.output
    assert not helpers.metrics(tmp_path, "train", missing_ok=True)


def test_a_snapshot_write_slower_than_dist_timeout_s_is_a_recorded_failure_with_its_line(tmp_path):
    # Rank 1 waits on the Gloo side group while rank 0 writes (on NCCL's group torch's watchdog would end
    # it from C++, without a word); the failure names the wait, the phase and the setting to raise.
    r = helpers.torchrun(2, f"run.dir={tmp_path}", "dist.timeout_s=6", "drill.snapshot_write_delay_s=15",
                         "train.max_steps=12", "snapshot.every_steps=5", *helpers.QUICK, timeout=180)
    assert r.returncode != 0
    waited = "waited dist.timeout_s=6 s for rank 0's file work"
    assert (f"trainapp: rank 1 on {os.uname().nodename} failed after step 5 in phase snapshot: timeout: "
            in r.output)
    assert f"trainapp train: error: {waited}" in r.output, r.output[-3000:]
    failures = {f["rank"]: f for f in helpers.metrics(tmp_path, "failure")}
    assert (failures[1]["cause"] == "timeout" and failures[1]["phase"] == "snapshot"
            and waited in failures[1]["error"])
    assert failures[0]["cause"] == "peer" and failures[0]["step"] == 5, failures


# --- CUDA's generator: only the rank's own device --------------------------------------------------------

class StandInCuda:
    """CUDA's per-device generators as torch.cuda exposes them (`get_rng_state(device)`,
    `set_rng_state(state, device)`), for a machine without a GPU."""

    def __init__(self, devices: int):
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(devices)}

    def get_rng_state(self, device):
        return self.states[torch.device(device).index].clone()

    def set_rng_state(self, state, device):
        index = torch.device(device).index
        if index not in self.states:
            raise IndexError(f"no device {index}")  # what torch.cuda does past the visible devices
        self.states[index] = state.clone()


def test_only_the_ranks_own_cuda_generator_is_saved_and_restored():
    eight = StandInCuda(8)
    saved = rng_state(CUDA3, eight)
    assert saved["cuda"] == bytes([3] * 16)  # device 3's state alone, not all 8
    assert rng_state(torch.device("cpu"), eight)["cuda"] is None
    one = StandInCuda(1)  # the rank resumes on a node that shows it a single GPU
    set_rng_state(saved, CUDA0, one)
    assert one.states[0].tolist() == [3] * 16


def test_old_snapshots_with_every_gpus_generator_still_load():
    # torch's get_rng_state_all
    old = {**rng_state(torch.device("cpu")), "cuda": [bytes([i] * 16) for i in range(8)]}
    one = StandInCuda(1)
    set_rng_state(old, CUDA0, one)
    assert one.states[0].tolist() == [0] * 16
    four = StandInCuda(4)
    set_rng_state(old, CUDA3, four)
    assert four.states[3].tolist() == [3] * 16
    assert own_cuda_state(old["cuda"][:2], CUDA3) is None  # past the list: nothing to take, no IndexError
    set_rng_state({**old, "cuda": old["cuda"][:2]}, CUDA3, four)


# --- deterministic kernels -----------------------------------------------------------------------------

def test_train_deterministic_turns_on_deterministic_kernels(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
              torch.backends.cudnn.deterministic, torch.backends.cudnn.conv.fp32_precision,
              torch.backends.cuda.matmul.fp32_precision)
    try:
        chosen = kernels.configure(True, cuda=True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.conv.fp32_precision == "ieee"
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" == chosen["cublas_workspace_config"]
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[1], before[2]
        torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = before[3:]
    assert kernels.configure(False, cuda=False) == {"deterministic": False, "cudnn_benchmark": False}


# --- the interface: loopback in a job across hosts -------------------------------------------------------

def test_auto_choosing_loopback_is_refused_when_the_ranks_span_hosts():
    def report(host, address, request="auto"):
        return {"host": host, "request": request, "address": address, "rendezvous": "node0"}

    net.check_hosts([report("node0", "127.0.1.1"), report("node0", "127.0.1.1")])  # one host: lo is right
    net.check_hosts([report("node0", "10.0.0.1"), report("node1", "10.0.0.2")])
    # named: the user's
    net.check_hosts([report("node0", "127.0.0.1", "lo"), report("node1", "10.0.0.2", "lo")])
    with pytest.raises(net.NetworkError, match=r"rank 0 on host node0 reaches the rendezvous node0 "
                                               r"over loopback \(127.0.1.1\) while the ranks run on 2 hosts"):
        net.check_hosts([report("node0", "127.0.1.1"), report("node1", "10.0.0.2")])


# --- side groups: Gloo, with dist.timeout_s ---------------------------------------------------------------

LATE_RANK = """
import json, os, sys, time, torch, torch.distributed as tdist
from trainapp.config import DistSection
from trainapp.launch import dist
rank = int(os.environ["RANK"])
ctx = dist.setup(DistSection(timeout_s=2))
files, vote = ctx.files, ctx.new_side_group()
result = {"backend": tdist.get_backend(files.group), "distinct": files.group is not None,
          "vote_backend": tdist.get_backend(vote)}
for name, wait in (("files", files.barrier), ("vote", lambda: tdist.all_reduce(torch.zeros(1), group=vote))):
    if rank == 1:
        time.sleep(5)  # rank 0's file work, slower than dist.timeout_s
        continue
    t0 = time.monotonic()
    try:
        wait()
        result[name] = ["returned"]
    except Exception as e:  # Gloo's timeout raises; torch's default for a new group would wait 30 minutes
        result[name] = ["raised", time.monotonic() - t0, type(e).__name__]
print("RESULT", json.dumps(result), flush=True)
os._exit(0)  # the groups are broken by design: no teardown
"""


def test_side_groups_are_gloo_and_time_out_after_dist_timeout_s():
    port = free_port()
    procs = [subprocess.Popen([helpers.PY, "-c", LATE_RANK], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    line = next((ln for ln in outs[0].splitlines() if ln.startswith("RESULT ")), None)
    assert line, outs
    zero = json.loads(line.removeprefix("RESULT "))
    assert zero["backend"] == "gloo" and zero["distinct"] and zero["vote_backend"] == "gloo"
    for name in ("files", "vote"):
        assert zero[name][0] == "raised" and zero[name][1] < 4.5, zero  # 2 s, not torch's 30 minutes
    assert zero["files"][2] == "WaitTimeout" and zero["vote"][2] == "RuntimeError", zero  # the wait named


def test_doctor_says_where_a_rank_would_train_and_what_would_stop_it(tmp_path):
    from trainapp import config
    from trainapp.tools import doctor

    here = doctor.check_device(config.load(None, [f"run.dir={tmp_path}"]))
    assert here.status == doctor.OK and ("cpu (dist.device=auto" in here.detail or "cuda" in here.detail)
    if not torch.cuda.is_available():
        refused = doctor.check_device(config.load(None, [f"run.dir={tmp_path}", "dist.device=cuda"]))
        assert (refused.status == doctor.FAIL
                and refused.detail.startswith("dist.device=cuda: CUDA is not usable"))


def test_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_2():
    """`make gpu-check` is prepared for the day a GPU is at hand; here (no CUDA) it checks nothing."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: make gpu-check runs its checks")
    r = helpers.run_cmd([helpers.PY, "scripts/gpu_check.py"], timeout=120)
    assert r.returncode == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpu-check: error: no CUDA device"), r.output
    assert helpers.run_cmd(["make", "--no-print-directory", "gpu-check"], timeout=120).returncode == 2
