#!/usr/bin/env python3
"""`make gpu-check`: the GPU path of trainapp checked on a real GPU in about five minutes, and one check
without one. Every test of `make test` runs on CPU with Gloo; this is what a session with a GPU machine
runs to see the CUDA side: the device choice, autocast in bf16 and fp16, bitwise resume with
deterministic kernels, NCCL.

Each check prints a progress line when it starts and one result line, `gpu-check: PASS|FAIL|SKIP|INFO
ID TITLE: key=value ...`; INFO is a result that is reported, not judged. Every check starts real
`python -m trainapp train` processes (torchrun as `python -m torch.distributed.run`), each in its own
session, SIGKILLed as a group on a timeout; their run directories live in one temporary directory,
removed at the end.

On a machine without CUDA (torch.cuda.is_available() False) it checks nothing: one line says so, exit
code 2 (tests/test_gpu_path.py runs it so). With CUDA, in this order:
    e-refuse-cuda    `dist.device=cuda` with `CUDA_VISIBLE_DEVICES=` (empty): exit 2, exactly one line,
                     `trainapp train: error: dist.device...`, no traceback, run.dir not created; whether
                     the line names that variable is reported, not judged
    a-auto-image     one process, `dist.device` and `amp.dtype` left at auto, 10 steps of the image task
    a-auto-char_lm   (SmallCNN, synthetic data) and of char_lm: exit 0, the start record's device cuda
                     and amp bf16 on a GPU of compute capability >= 8.0 (fp16 below), losses finite,
                     the model exported
    b-fp16-image     `amp.dtype=fp16`, 20 steps: exit 0, amp fp16, every loss and the validation loss
    b-fp16-char_lm   finite, `loss_scale` in every train record (finite, > 0), the skipped steps counted
    d-bitwise-image  `train.deterministic=true`: a straight run of 24 steps, and a twin whose process
    d-bitwise-char_lm  SIGKILLs itself after step 13 (`drill.kill_at_step`) and is started again: it
                     resumes from step 10 and ends with the straight run's parameters, bit for bit
                     (every tensor of model/model.safetensors equal under torch.equal, and the final
                     snapshots' `params_sha256`); char_lm with dropout 0.1 (the CUDA generator resumed)
                     (every pair with `snapshot.memory_every_steps=0`: storage resumes it)
    d-memory-char_lm the char_lm pair with a memory-tier copy every step (the GPU's tensors copied to a
                     slot in /dev/shm): the twin resumes from memory at step 12 (`resumed_tier` memory)
                     and ends equal to d-bitwise-char_lm's straight run; its memory directory left empty
    d-nondet-image   INFO: the same pair of the image task without `train.deterministic` (cuDNN's
                     autotuner on, TF32): bitwise equal or not, and by how much it differs
    e-cpu            `dist.device=cpu` on the GPU machine trains on the CPU (start record device cpu)
    c-nccl-ddp       2 ranks under torchrun over NCCL, 10 steps (DDP with `model.sync_bn=true`, then
    c-nccl-fsdp      FSDP): backend nccl, world size 2; with 2 or more GPUs only (NCCL refuses two
                     ranks on one GPU), else SKIP
    f-fewer-ddp      c's 2-rank snapshots (step 10) resumed by one rank shown one GPU (the last, by
    f-fewer-fsdp     `CUDA_VISIBLE_DEVICES`): exit 0, resumed at step 10 from world size 2, on to 20;
                     with 2 or more GPUs only, else SKIP
    g-compile        a 4-layer 512-wide char_lm eager and with `parallel.compile=true`, 30 steps each:
                     step times (median after step 5) and their ratio, the losses side by side (INFO
                     beyond both finishing); then the compiled run resumed for 5 more steps with an
                     empty TORCHINDUCTOR_CACHE_DIR: nothing compiled again (the carried cache), its
                     first step's seconds beside the cold run's
    g-ckpt-memory    the same model's peak CUDA memory for one bf16 training step at 1024-character
                     blocks with `activation_checkpoint` none and full (in this process): the ratio,
                     target <= 0.6 of the activation memory (peak less the weights' and the optimizer's)
    g-sharded        `parallel.strategy=fsdp` on an NCCL process group of one (torchrun, 1 process), 10
                     steps: backend nccl, its snapshots sharded (torch.distributed.checkpoint files)
    g-resnet50       INFO: ResNet-50 training images/s at batch 128 (bf16 autocast, channels_last, SGD,
                     synthetic 224x224 images in GPU memory, 30 timed steps), beside NVIDIA's published
                     single-GPU mixed-precision figure for the same GPU where there is one

Results: one JSON summary (GPU names and memory, compute capability, torch, CUDA, cuDNN and NCCL
versions, the driver from nvidia-smi when present, each check's status, numbers and seconds, and the
last lines of a failed run's output) in bench/results/gpu.json, and in $OUT/gpu.json when OUT is set;
there also each run's output and metrics.jsonl (gpu_check/NAME.log, NAME.metrics.jsonl).

Usage:  make gpu-check      (or .venv/bin/python scripts/gpu_check.py [--budget-s 420])
No run starts with less than 20 s of --budget-s left, and a run still going when it is spent is killed
(its check fails): the whole check ends in about the budget. One run may take at most 150 s.
CUBLAS_WORKSPACE_CONFIG is removed from the runs' environment: trainapp sets it for
`train.deterministic=true`, and the other runs must go without it.
Exit status: 0 every check passed (or was skipped or informational), 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from trainapp.observe.metrics import read as read_metrics  # the one reader of metrics.jsonl

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
RUN_TIMEOUT_S = 150.0
MIN_START_S = 20.0
"""A run is not started with less of the budget left than this."""
QUICK = ["train.progress=false", "train.log_every=5"]
TASKS = {
    "image": ["data.train_size=1024", "data.val_size=256"],
    "char_lm": ["task.name=char_lm", "train.epochs=10"],
}
CUDA = ["dist.device=cuda"]
BITWISE = ["train.max_steps=24", "train.epochs=10", "snapshot.every_steps=5", "train.grad_accum=2",
           "train.ema_decay=0.9", "train.eval_every=10"]
STORAGE_ONLY = ["snapshot.memory_every_steps=0"]
"""The bitwise pairs resume from storage: the memory tier (default `auto`) would resume them from memory."""
KILL_AT, RESUME_AT, MEMORY_RESUME_AT = 13, 10, 12
"""The drill kills after step 13: the snapshot of step 10 (every 5) is where the twin resumes from storage,
the copy of step 12 where it resumes from memory (a copy every step; the kill comes before step 13's)."""


class OutOfTime(Exception):
    pass


@dataclass
class Run:
    name: str
    run_dir: Path
    rc: int | None
    """None: killed at its timeout."""
    output: str
    seconds: float

    def records(self, kind: str) -> list[dict[str, Any]]:
        return read_metrics(self.run_dir, kind, missing_ok=True)

    def start(self) -> dict[str, Any]:
        starts = self.records("start")
        return starts[-1] if starts else {}

    def end(self) -> dict[str, Any]:
        ends = self.records("end")
        return ends[-1] if ends else {}


@dataclass
class Verdict:
    """A check's outcome: its numbers, and what was wrong (nothing: PASS)."""

    numbers: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)
    """The last lines of the first run that did not end as expected."""
    status: str = ""
    """SKIP or INFO; empty: PASS or FAIL from the problems."""

    def need(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.problems.append(problem)
        return ok

    def ran(self, run: Run, rc: int = 0) -> bool:
        ok = self.need(run.rc == rc, f"{run.name}: exit {run.rc}, expected {rc}")
        if not ok and not self.tail:
            self.tail = run.output.splitlines()[-25:]
        return ok


class Session:
    """The runs of one gpu-check: where they go, how long they may take, where their logs are kept."""

    def __init__(self, scratch: Path, budget_s: float, out: Path | None):
        self.scratch, self.out = scratch, out
        self.deadline = time.monotonic() + budget_s
        self.budget_s = budget_s
        self.env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
        self.env.update(PYTHONUNBUFFERED="1", TMPDIR=str(scratch / "tmp"))
        self.env.setdefault("OMP_NUM_THREADS", "4")
        (scratch / "tmp").mkdir()

    def train(self, name: str, args: list[str], env: dict[str, str] | None = None, nproc: int = 0,
              run_dir: Path | None = None) -> Run:
        """`trainapp train ARGS run.dir=...` alone, or under torchrun with `nproc` processes."""
        run_dir = run_dir or self.scratch / name
        launcher = ([PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc
                    else [PY])
        return self.command(name, [*launcher, "-m", "trainapp", "train", *QUICK, *args, f"run.dir={run_dir}"],
                            run_dir, env)

    def command(self, name: str, cmd: list[str], run_dir: Path, env: dict[str, str] | None = None) -> Run:
        left = self.deadline - time.monotonic()
        if left < MIN_START_S:
            raise OutOfTime(f"not run: the budget of {self.budget_s:.0f} s is spent")
        began = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=min(RUN_TIMEOUT_S, left))
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            out, rc = out + f"\n[gpu-check: killed after {time.monotonic() - began:.0f} s]", None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what is left of this run's own session only
            except ProcessLookupError:
                pass
        run = Run(name, run_dir, rc, out, time.monotonic() - began)
        self._keep(run)
        return run

    def _keep(self, run: Run) -> None:
        if self.out is None:
            return
        logs = self.out / "gpu_check"
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{run.name}.log").write_text(run.output)
        if (run.run_dir / "metrics.jsonl").exists():
            shutil.copyfile(run.run_dir / "metrics.jsonl", logs / f"{run.name}.metrics.jsonl")

    def params_sha256(self, run_dir: Path) -> str | None:
        """`trainapp inspect RUN_DIR`'s hash of the newest snapshot's parameters; None if it failed."""
        left = max(10.0, self.deadline - time.monotonic())
        r = subprocess.run([PY, "-m", "trainapp", "inspect", str(run_dir)], cwd=REPO, env=self.env,
                           capture_output=True, text=True, timeout=min(60.0, left))
        return json.loads(r.stdout).get("params_sha256") if r.returncode == 0 else None


# ---- what a run's records must say


def finite_losses(v: Verdict, run: Run) -> None:
    losses = [r.get("loss") for r in run.records("train")]
    v.need(bool(losses), f"{run.name}: no train record")
    v.need(all(isinstance(x, (int, float)) and math.isfinite(x) for x in losses),
           f"{run.name}: a loss that is not finite: {losses}")
    if losses:
        v.numbers["loss"] = f"{losses[0]:.3f}->{losses[-1]:.3f}"


def auto_dtype() -> str:
    """What `amp.dtype=auto` should choose on GPU 0: bf16 from compute capability 8.0 (Ampere's bf16
    tensor cores; below it bf16 is emulated), fp16 with loss scaling below; ROCm: bf16."""
    if torch.version.hip:
        return "bf16"
    return "bf16" if torch.cuda.get_device_capability(0) >= (8, 0) else "fp16"


# ---- the checks


def refuse_cuda(s: Session, name: str, env: dict[str, str] | None = None) -> Verdict:
    v = Verdict()
    run = s.train(name, [*CUDA, "train.max_steps=1"], env=env)
    lines = [line for line in run.output.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    v.numbers.update(rc=run.rc, lines=len(lines), seconds=round(run.seconds, 1))
    v.need(run.rc == 2, f"exit {run.rc}, expected 2")
    v.need(len(lines) == 1, f"{len(lines)} lines of output, expected 1")
    v.need("Traceback" not in run.output, "a traceback")
    v.need(first.startswith("trainapp train: error: dist.device"), "the line does not start with "
           "`trainapp train: error: dist.device`")
    v.need("unknown key" not in first, "dist.device is not a key of this trainapp yet")
    v.need(not run.run_dir.exists(), "run.dir was created")
    if v.problems:
        v.tail = lines[-25:]
    if env and "CUDA_VISIBLE_DEVICES" in env:  # reported, not judged: does the line say what hid the GPUs?
        v.numbers["names_cuda_visible_devices"] = "CUDA_VISIBLE_DEVICES" in first
    v.numbers["line"] = first
    return v


def amp_auto(s: Session, task: str) -> Verdict:
    """dist.device and amp.dtype left at auto: cuda and bf16 (fp16 before compute capability 8.0)."""
    v = Verdict()
    run = s.train(f"a-auto-{task}", [*TASKS[task], "train.max_steps=10"])
    if v.ran(run):
        start, end = run.start(), run.end()
        v.numbers.update(device=start.get("device"), amp=start.get("amp"), steps=end.get("steps"))
        v.need(str(start.get("device")).startswith("cuda"), f"device {start.get('device')}, expected cuda")
        v.need(start.get("amp") == auto_dtype(), f"amp {start.get('amp')}, expected {auto_dtype()}")
        finite_losses(v, run)
        v.need((run.run_dir / "model" / "model.safetensors").exists(), "no model/model.safetensors")
        v.numbers["samples_per_s"] = round(end.get("samples_per_s") or 0.0, 1)
        if start.get("amp_why"):
            v.numbers["amp_why"] = start["amp_why"]
    v.numbers["seconds"] = round(run.seconds, 1)
    return v


def fp16(s: Session, task: str) -> Verdict:
    v = Verdict()
    run = s.train(f"b-fp16-{task}", [*CUDA, *TASKS[task], "amp.dtype=fp16", "train.max_steps=20"])
    if v.ran(run):
        start, end, train = run.start(), run.end(), run.records("train")
        v.need(start.get("amp") == "fp16", f"amp {start.get('amp')}, expected fp16")
        finite_losses(v, run)
        scales = [r.get("loss_scale") for r in train]
        v.need(bool(scales) and all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0
                                    for x in scales),
               f"loss_scale not in every train record, or not finite and > 0: {scales}")
        v.need(math.isfinite(end.get("val_loss", float("nan"))), f"val_loss {end.get('val_loss')}")
        v.numbers.update(loss_scale=scales[-1] if scales else None, skipped_steps=end.get("skipped_steps"),
                         val_loss=round(end.get("val_loss", float("nan")), 4))
    v.numbers["seconds"] = round(run.seconds, 1)
    return v


def compare_models(a: Path, b: Path) -> dict[str, Any]:
    """Every tensor of two exports under torch.equal: how many, how many differ, the largest difference."""
    from safetensors.torch import load_file

    ta, tb = (load_file(str(d / "model" / "model.safetensors")) for d in (a, b))
    differ = sorted(n for n in set(ta) | set(tb)
                    if n not in ta or n not in tb or not torch.equal(ta[n], tb[n]))
    gaps = [(ta[n].double() - tb[n].double()).abs().max().item() for n in differ
            if n in ta and n in tb and ta[n].shape == tb[n].shape]
    return {"tensors": len(ta), "differ": len(differ), "max_abs_diff": max(gaps, default=0.0)}


def same_params(s: Session, a: Path, b: Path) -> tuple[bool, dict[str, Any], tuple[str | None, str | None]]:
    """Whether two runs ended with the same parameters (every exported tensor equal and the final
    snapshots' `params_sha256`), the tensors compared, and the two hashes."""
    models = compare_models(a, b)
    shas = (s.params_sha256(a), s.params_sha256(b))
    return models["differ"] == 0 and shas[0] is not None and shas[0] == shas[1], models, shas


def bitwise(s: Session, name: str, task: str, deterministic: bool, extra: tuple[str, ...] = ()) -> Verdict:
    """A straight run and a twin SIGKILLed after step 13 and started again: the same parameters?"""
    v = Verdict(status="" if deterministic else "INFO")
    args = [*CUDA, *TASKS[task], *BITWISE, *STORAGE_ONLY, *extra,
            f"train.deterministic={str(deterministic).lower()}"]
    straight = s.train(f"{name}-straight", args)
    killed = s.train(f"{name}-killed", [*args, f"drill.kill_at_step={KILL_AT}"])
    resumed = s.train(f"{name}-resumed", [*args, f"drill.kill_at_step={KILL_AT}"], run_dir=killed.run_dir)
    v.numbers["seconds"] = round(straight.seconds + killed.seconds + resumed.seconds, 1)
    ended = [v.ran(straight), v.ran(killed, rc=-signal.SIGKILL), v.ran(resumed)]
    if not all(ended):  # a failure, informational check or not
        return v
    resumed_at = [st.get("resumed_step") for st in resumed.records("start")]
    v.need(resumed_at == [None, RESUME_AT],
           f"start records' resumed_step {resumed_at}, expected [None, {RESUME_AT}]")
    config = straight.start().get("config", {}).get("train", {})
    v.need(config.get("deterministic") is deterministic,
           f"the start record's train.deterministic is {config.get('deterministic')}")
    steps = (straight.end().get("steps"), resumed.end().get("steps"))
    v.need(steps == (24, 24), f"final steps {steps}, expected 24 and 24")
    equal, models, shas = same_params(s, straight.run_dir, killed.run_dir)
    v.numbers.update(bitwise_equal=equal, tensors=models["tensors"], tensors_differ=models["differ"],
                     max_abs_diff=f"{models['max_abs_diff']:.3g}",
                     snapshot_sha_equal=shas[0] is not None and shas[0] == shas[1])
    if straight.start().get("kernels") is not None:
        v.numbers["kernels"] = straight.start()["kernels"]
    if deterministic:
        v.need(equal, "the resumed twin's parameters differ from the straight run's")
    return v


def memory_resume(s: Session) -> Verdict:
    """char_lm with dropout (the CUDA generator is in the copy) and a memory-tier copy every step, killed
    after step 13 and started again: resumed from memory at step 12, equal to d-bitwise-char_lm's straight
    run (its own straight run when that one is missing). The copies are the GPU tensors copied to the host."""
    v = Verdict()
    base = [*CUDA, *TASKS["char_lm"], *BITWISE, "task.args.dropout=0.1", "train.deterministic=true"]
    straight_dir = s.scratch / "d-bitwise-char_lm-straight"
    if not (straight_dir / "model" / "model.safetensors").exists():
        straight = s.train("d-memory-char_lm-straight", [*base, *STORAGE_ONLY])
        if not v.ran(straight):
            return v
        straight_dir = straight.run_dir
    shm = Path(tempfile.mkdtemp(prefix="ta-gpu-check-", dir="/dev/shm"))
    try:
        args = [*base, "snapshot.memory_every_steps=1", f"snapshot.memory_dir={shm}",
                f"drill.kill_at_step={KILL_AT}"]
        killed = s.train("d-memory-char_lm-killed", args)
        resumed = s.train("d-memory-char_lm-resumed", args, run_dir=killed.run_dir)
        left = sorted(p.name for p in shm.iterdir())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    v.numbers["seconds"] = round(killed.seconds + resumed.seconds, 1)
    if not (v.ran(killed, rc=-signal.SIGKILL) and v.ran(resumed)):
        return v
    starts = [(st.get("resumed_step"), st.get("resumed_tier")) for st in resumed.records("start")]
    v.need(starts == [(None, None), (MEMORY_RESUME_AT, "memory")],
           f"start records' (resumed_step, resumed_tier) {starts}, expected [(None, None), "
           f"({MEMORY_RESUME_AT}, 'memory')]")
    memory = resumed.end().get("memory_tier") or {}
    equal, models, _ = same_params(s, straight_dir, killed.run_dir)
    v.numbers.update(bitwise_equal=equal, tensors_differ=models["differ"],
                     max_abs_diff=f"{models['max_abs_diff']:.3g}", copy_ms=memory.get("copy_ms"),
                     left_in_memory=left)
    v.need(equal, "the twin resumed from memory differs from the straight run")
    v.need(left in ([], ["node-id"]), f"the finished run left {left} in its memory directory")
    return v


def nccl(s: Session, strategy: str) -> Verdict:
    v = Verdict()
    args = [*CUDA, *TASKS["image"], f"parallel.strategy={strategy}", "train.max_steps=10",
            "snapshot.every_steps=5"]
    run = s.train(f"c-nccl-{strategy}", [*args, *(["model.sync_bn=true"] if strategy == "ddp" else [])],
                  nproc=2)
    if v.ran(run):
        start = run.start()
        devices = [p["device"] for p in start.get("placement") or [] if "device" in p]  # where placement says
        v.numbers.update(backend=start.get("backend"), world_size=start.get("world_size"),
                         device=start.get("device"), **({"devices": devices} if devices else {}))
        v.need(start.get("backend") == "nccl", f"backend {start.get('backend')}, expected nccl")
        v.need(start.get("world_size") == 2, f"world size {start.get('world_size')}, expected 2")
        v.need(len(set(devices)) == len(devices), f"ranks share a GPU: {devices}")
        finite_losses(v, run)
    v.numbers["seconds"] = round(run.seconds, 1)
    return v


def fewer_gpus(s: Session, strategy: str) -> Verdict:
    """c's 2-rank snapshot of step 10 resumed by one rank that is shown one GPU, the last."""
    v = Verdict()
    run_dir = s.scratch / f"c-nccl-{strategy}"
    if not v.need((run_dir / "snapshots").is_dir(), f"no snapshots from c-nccl-{strategy} to resume"):
        return v
    last = str(torch.cuda.device_count() - 1)
    args = [*CUDA, *TASKS["image"], f"parallel.strategy={strategy}", "train.max_steps=20",
            "snapshot.every_steps=5"]
    run = s.train(f"f-fewer-{strategy}", args, env={"CUDA_VISIBLE_DEVICES": last}, nproc=1, run_dir=run_dir)
    if v.ran(run):
        start = run.start()
        got = (start.get("resumed_step"), start.get("resumed_world_size"), start.get("world_size"))
        v.numbers.update(visible=last, resumed=got, steps=run.end().get("steps"), device=start.get("device"))
        v.need(got == (10, 2, 1),
               f"(resumed_step, resumed_world_size, world_size) {got}, expected (10, 2, 1)")
        v.need(run.end().get("steps") == 20, f"final step {run.end().get('steps')}, expected 20")
        finite_losses(v, run)
    v.numbers["seconds"] = round(run.seconds, 1)
    return v


def on_cpu(s: Session) -> Verdict:
    v = Verdict()
    run = s.train("e-cpu", ["dist.device=cpu", *TASKS["image"], "train.max_steps=3"])
    if v.ran(run):
        v.numbers.update(device=run.start().get("device"), backend=run.start().get("backend"))
        v.need(run.start().get("device") == "cpu", f"device {run.start().get('device')}, expected cpu")
    v.numbers["seconds"] = round(run.seconds, 1)
    return v


LM_BIG = ["task.name=char_lm", "task.args.n_layer=4", "task.args.n_embd=512", "task.args.n_head=8",
          "task.args.block_size=256", "train.batch_size=32", "train.epochs=10", "train.log_every=1",
          "snapshot.every_steps=30"]
RESNET50_PUBLISHED = {
    "A100": (2470, "A100 80GB, 1 GPU, mixed precision, batch 256, ImageNet through DALI, pytorch-21.03"),
    "V100-SXM2-16GB": (1200, "V100 16GB, 1 GPU, mixed precision, batch 256, ImageNet through DALI"),
    "V100-SXM2-32GB": (1156, "V100 32GB, 1 GPU, mixed precision, batch 256, ImageNet through DALI"),
}
"""NVIDIA's training throughput of ResNet-50 v1.5 (DeepLearningExamples, PyTorch/Classification/ConvNets/
resnet50v1.5/README.md, "Training performance results"), by a part of the GPU's name; none there for
other GPUs."""


def step_ms(run: Run, skip: int = 5) -> float | None:
    """The median step time of the run's last attempt, its first `skip` steps left out."""
    batch, trains = run.start().get("global_batch"), run.records("train")[skip:]
    if not batch or not trains:
        return None
    times = sorted(batch / r["samples_per_s"] * 1000 for r in trains if r.get("samples_per_s"))
    return round(times[len(times) // 2], 2) if times else None


def first_step_s(run: Run) -> float | None:
    start = run.start()
    trains = [r for r in run.records("train") if r["step"] > (start.get("step") or 0)]
    return round(trains[0]["time"] - start["time"], 2) if start and trains else None


def compiled(s: Session) -> Verdict:
    v = Verdict()
    args = [*CUDA, *LM_BIG, "train.max_steps=30"]
    eager = s.train("g-eager", args, env={"TORCHINDUCTOR_CACHE_DIR": str(s.scratch / "inductor-1")})
    comp = s.train("g-compiled", [*args, "parallel.compile=true"],
                   env={"TORCHINDUCTOR_CACHE_DIR": str(s.scratch / "inductor-1")})
    if not (v.ran(eager) and v.ran(comp)):
        return v
    finite_losses(v, comp)
    e, c = step_ms(eager), step_ms(comp)
    losses = [(a.get("loss"), b.get("loss")) for a, b in zip(eager.records("train"), comp.records("train"))]
    diff = max((abs(a - b) / abs(a) for a, b in losses), default=None)
    v.numbers.update(eager_step_ms=e, compiled_step_ms=c, loss_rel_diff_max=diff,
                     compile_step_ratio=round(c / e, 3) if e and c else None,
                     cold_first_step_s=first_step_s(comp))
    resumed = s.train("g-compiled-resume", [*args, "parallel.compile=true", "train.max_steps=35"],
                      env={"TORCHINDUCTOR_CACHE_DIR": str(s.scratch / "inductor-2")}, run_dir=comp.run_dir)
    if v.ran(resumed):
        cache = resumed.start().get("parallel", {}).get("compile", {}).get("cache", {})
        line = next((ln for ln in resumed.output.splitlines() if "graphs by the first step" in ln), "")
        v.numbers.update(warm_first_step_s=first_step_s(resumed), carried_files=cache.get("files"),
                         first_step_line=line.split("parallel.compile: ")[-1])
        v.need(bool(cache.get("files")), f"the resume loaded no carried compile cache: {cache}")
        v.need("0 compiled; AOTAutograd's" in line and line.endswith(" 0 compiled"),
               f"the warm resume compiled again: {line!r}")
    return v


def ckpt_memory(s: Session) -> Verdict:
    """Peak memory of one bf16 training step, activation checkpointing off and on, in this process."""
    from trainapp.core.parallel import checkpointing
    from trainapp.tasks.char_lm import CharTransformer

    v = Verdict()
    peaks = {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = CharTransformer(96, 1024, 4, 8, 512, dropout=0.0).cuda()
        opt = torch.optim.AdamW(model.parameters())
        if mode == "full":
            checkpointing.checkpoint(list(model.blocks))
        x = torch.randint(0, 96, (16, 1024), device="cuda")
        for _ in range(2):  # the optimizer's state exists from the first step on
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated() - base
        del model, opt, x, loss
        torch.cuda.empty_cache()
    ratio = peaks["full"] / peaks["none"]
    v.numbers.update(activation_mib={k: round(b / 2**20, 1) for k, b in peaks.items()}, ratio=round(ratio, 3))
    v.need(ratio <= 0.6, f"checkpointing kept {ratio:.2f} of the step's memory above the weights, target "
           "<= 0.6")
    return v


def sharded(s: Session) -> Verdict:
    v = Verdict()
    run = s.train("g-sharded", [*CUDA, *TASKS["image"], "parallel.strategy=fsdp", "train.max_steps=10",
                                "snapshot.every_steps=5"], nproc=1)
    if v.ran(run):
        start = run.start()
        meta = run.run_dir / "snapshots" / "step_000000010" / "meta.json"
        shards = sorted(json.loads(meta.read_text()).get("shards", {})) if meta.exists() else []
        v.numbers.update(backend=start.get("backend"), world_size=start.get("world_size"), shards=shards)
        v.need(start.get("backend") == "nccl", f"backend {start.get('backend')}, expected nccl")
        v.need(any(n.endswith(".distcp") for n in shards),
               f"the snapshot of step 10 is not sharded: {shards}")
    v.numbers["seconds"] = round(run.seconds, 1)
    return v


def resnet50(s: Session) -> Verdict:
    """Images/s of ResNet-50 training at batch 128 on synthetic images, beside NVIDIA's figure."""
    import torchvision

    v = Verdict(status="INFO")
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(128, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (128,), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    rate = 30 * 128 / (time.perf_counter() - t0)
    name = torch.cuda.get_device_name(0)
    published = next((f for key, f in RESNET50_PUBLISHED.items() if key in name), None)
    v.numbers.update(gpu=name, images_per_s=round(rate, 1),
                     published=published[0] if published else None,
                     published_setup=published[1] if published else "no published figure for this GPU",
                     ratio=round(rate / published[0], 3) if published else None)
    return v


def with_two_gpus(fn: Callable[[], Verdict], reason: str) -> Callable[[], Verdict]:
    """`fn` with 2 or more GPUs; else a SKIP that says why."""
    if torch.cuda.device_count() >= 2:
        return fn
    return lambda: Verdict(numbers={"gpus": torch.cuda.device_count(), "why": reason}, status="SKIP")


def gpu_checks(s: Session) -> list[tuple[str, str, Callable[[], Verdict]]]:
    """(id, title, check) in the order they run: the cheap and the must-pass first."""
    one_gpu = "one GPU: NCCL refuses two ranks on one device, and a 2-rank check needs 2 GPUs"
    fewer = "one GPU: no snapshot can be written while more GPUs are visible"
    return [
        ("e-refuse-cuda", "dist.device=cuda with CUDA_VISIBLE_DEVICES= (empty)",
         lambda: refuse_cuda(s, "e-refuse-cuda", {"CUDA_VISIBLE_DEVICES": ""})),
        ("a-auto-image", "dist.device and amp.dtype auto, image task", lambda: amp_auto(s, "image")),
        ("a-auto-char_lm", "dist.device and amp.dtype auto, char_lm", lambda: amp_auto(s, "char_lm")),
        ("b-fp16-image", "amp.dtype=fp16 with loss scaling, image task", lambda: fp16(s, "image")),
        ("b-fp16-char_lm", "amp.dtype=fp16 with loss scaling, char_lm", lambda: fp16(s, "char_lm")),
        ("d-bitwise-image", "train.deterministic=true, killed at step 13 and resumed = straight, image task",
         lambda: bitwise(s, "d-bitwise-image", "image", True)),
        ("d-bitwise-char_lm", "train.deterministic=true, killed and resumed = straight, char_lm with dropout",
         lambda: bitwise(s, "d-bitwise-char_lm", "char_lm", True, ("task.args.dropout=0.1",))),
        ("d-memory-char_lm", "a memory-tier copy every step: killed at step 13, resumed from memory at 12 "
         "= straight, char_lm with dropout", lambda: memory_resume(s)),
        ("d-nondet-image", "the same pair without train.deterministic (informational)",
         lambda: bitwise(s, "d-nondet-image", "image", False)),
        ("e-cpu", "dist.device=cpu on a GPU machine trains on the CPU", lambda: on_cpu(s)),
        ("c-nccl-ddp", "2 ranks over NCCL, DDP with model.sync_bn=true",
         with_two_gpus(lambda: nccl(s, "ddp"), one_gpu)),
        ("c-nccl-fsdp", "2 ranks over NCCL, FSDP", with_two_gpus(lambda: nccl(s, "fsdp"), one_gpu)),
        ("f-fewer-ddp", "c's DDP snapshot resumed by 1 rank shown 1 GPU",
         with_two_gpus(lambda: fewer_gpus(s, "ddp"), fewer)),
        ("f-fewer-fsdp", "c's FSDP snapshot resumed by 1 rank shown 1 GPU",
         with_two_gpus(lambda: fewer_gpus(s, "fsdp"), fewer)),
        ("g-compile", "char_lm eager and compiled, the compiled one resumed warm on an empty local cache",
         lambda: compiled(s)),
        ("g-ckpt-memory", "peak memory with activation checkpointing none and full", lambda: ckpt_memory(s)),
        ("g-sharded", "FSDP on an NCCL process group of one: sharded snapshots", lambda: sharded(s)),
        ("g-resnet50", "ResNet-50 images/s at batch 128 beside NVIDIA's figure", lambda: resnet50(s)),
    ]


# ---- running them, the summary


def run_check(cid: str, title: str, fn: Callable[[], Verdict], announce: bool = True) -> dict[str, Any]:
    """Run one check and print its result line (its problems and a failed run's last lines below it)."""
    if announce:
        print(f"gpu-check: [{cid}] {title} ...", flush=True)
    began = time.monotonic()
    try:
        v = fn()
    except OutOfTime as e:
        v = Verdict(problems=[str(e)])
    except Exception as e:  # a check that breaks is a failed check; the others still run
        v = Verdict(problems=[f"{type(e).__name__}: {e}"])
    status = v.status if v.status and not v.problems else ("FAIL" if v.problems else "PASS")
    seconds = round(time.monotonic() - began, 1)
    numbers = {**{k: x for k, x in v.numbers.items() if k != "seconds"},
               "seconds": v.numbers.get("seconds", seconds)}
    shown = " ".join(f"{k}={json.dumps(x) if isinstance(x, (str, list, tuple, dict)) else x}"
                     for k, x in numbers.items())
    print(f"gpu-check: {status} {cid} {title}: {shown}", flush=True)
    for line in [*v.problems, *(f"| {line[:300]}" for line in v.tail)]:  # all of it in the JSON and the logs
        print(f"gpu-check:     {line}", flush=True)
    return {"id": cid, "title": title, "status": status, "seconds": seconds, "numbers": v.numbers,
            "problems": v.problems, "tail": v.tail}


def nvidia_smi() -> dict[str, Any]:
    """The driver version and each GPU's row from nvidia-smi, where there is one."""
    if not shutil.which("nvidia-smi"):
        return {"driver": None}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return {"driver": None, "nvidia_smi": f"{type(e).__name__}: {e}"}
    rows = [[c.strip() for c in line.split(",")] for line in smi.stdout.splitlines() if line.strip()]
    return {"driver": rows[0][1] if rows and len(rows[0]) > 1 else None, "nvidia_smi": rows}


def machine() -> dict[str, Any]:
    """What the results were measured on."""
    info: dict[str, Any] = {"host": socket.gethostname(), "python": platform.python_version(),
                            "torch": torch.__version__, "cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count()}
    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        info["commit"] = git.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None  # a copy of the working tree without .git
    info.update(nvidia_smi())
    if info["cuda_available"]:
        nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
        info["cudnn"] = torch.backends.cudnn.version()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if nccl else None
        info["gpus"] = [{"index": i, "name": torch.cuda.get_device_name(i),
                         "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                         "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                        for i in range(torch.cuda.device_count())]
    return info


def write_summary(summary: dict[str, Any], out: Path | None) -> list[Path]:
    """bench/results/gpu.json, and $OUT/gpu.json when OUT is set."""
    paths = [REPO / "bench" / "results" / "gpu.json"] + ([out / "gpu.json"] if out else [])
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return paths


def run_all(s: Session, info: dict[str, Any]) -> list[dict[str, Any]]:
    gpus = ", ".join(f"{g['name']} (cc {g['capability']}, {g['memory_gib']} GiB)" for g in info["gpus"])
    print(f"gpu-check: {len(info['gpus'])} GPU(s): {gpus}; torch {info['torch']}, CUDA {info['cuda']}, "
          f"driver {info.get('driver')}; budget {s.budget_s:.0f} s", flush=True)
    return [run_check(*c) for c in gpu_checks(s)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no run after this many seconds (default 420: done in under 8 minutes)")
    args = parser.parse_args(argv)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if not torch.cuda.is_available():
        print(f"gpu-check: error: no CUDA device on this machine (torch {torch.__version__}, CUDA "
              f"{torch.version.cuda}: torch.cuda.is_available() is False); nothing to check: run it on a GPU "
              "machine", file=sys.stderr, flush=True)
        return 2
    began, info = time.monotonic(), machine()
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        checks = run_all(Session(scratch, args.budget_s, out), info)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    passed = all(c["status"] != "FAIL" for c in checks)
    summary = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **info,
               "passed": passed, "wall_s": round(time.monotonic() - began, 1), "checks": checks}
    paths = write_summary(summary, out)
    counts = " ".join(f"{k.lower()}={sum(c['status'] == k for c in checks)}"
                      for k in ("PASS", "FAIL", "SKIP", "INFO"))
    print(f"gpu-check: {'passed' if passed else 'FAILED'}: {counts} wall_s={summary['wall_s']} "
          + " ".join(map(str, paths)), flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
