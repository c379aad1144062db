"""FSDP2 (`parallel.strategy=fsdp`, trainapp/core/parallel/fsdp.py) with sharded snapshots (every rank's shard
through torch.distributed.checkpoint, trainapp/snapshots/store.py): a rank SIGKILLed and restarted by
torchrun ends bitwise equal to a straight run, a snapshot resumes at another world size (resharded), a
flipped byte in one shard makes the whole snapshot invalid, and what FSDP runs do not have yet stops in
one line. Under Ray: tests/test_ray.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import FSDP_RUN, PY, QUICK, REPO, inspect, metrics, run_cmd, torchrun, torchrun2
from test_preempt import Job, check_preempted, preempt_torchrun_cmd, rerun_resumes_exactly
from test_storage import mounts, no_leftovers, tmpfs  # noqa: F401  (mounts: the fixture)

FSDP = FSDP_RUN
# The character transformer, with fp16 loss scaling (an initial scale that overflows the first steps'
# gradients: skipped steps every rank must agree on) and the EMA copy sharded as the model. One layer of
# 32 wide: what the assertions need (2 of 24 steps skipped, shards on both ranks) in a sixth of the time
# of the default shape (2 layers of 96, 76 s a run here).
LM = ["task.name=char_lm", "task.args.n_embd=32", "task.args.n_layer=1", "task.args.block_size=32",
      "task.args.stride=64", "amp.dtype=fp16", "amp.init_scale=1e6", *FSDP]


def killed(run, *args: str):
    """`run`, trained by 2 torchrun workers with `args`, rank 1 SIGKILLed after step 13 and the group
    restarted once (its twin: `straight_run(torchrun2, *args)`)."""
    r = run_cmd(torchrun2(run, *args, "drill.kill_at_step=13", "drill.rank=1"))
    assert r.returncode == 0, r.output[-3000:]
    return run


@pytest.mark.slow
def test_a_killed_rank_restarted_by_torchrun_ends_bitwise_equal_to_a_straight_fsdp_run(fsdp_straight,
                                                                                        tmp_path):
    killed(tmp_path, *FSDP)
    starts = metrics(tmp_path, "start")
    assert [s["resumed_step"] for s in starts] == [None, 10]
    # Every rank wrote its shard; meta.json lists every file with its size and checksum.
    meta = json.loads((tmp_path / "snapshots" / "step_000000024" / "meta.json").read_text())
    assert sorted(meta["shards"]) == ["shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"]
    assert inspect(tmp_path)["params_sha256"] == inspect(fsdp_straight)["params_sha256"]
    # no gather of the whole model at each snapshot: inspect reads the shards
    assert "params_sha256" not in meta


@pytest.mark.slow
@pytest.mark.e2e
def test_in_fp32_too_a_killed_rank_ends_bitwise_equal_to_a_straight_fsdp_run(straight_run, tmp_path):
    """The test above runs under autocast (bf16 where the CPU has it); this one without (`amp.dtype=off`)."""
    fp32 = [*FSDP, "amp.dtype=off"]
    run = killed(tmp_path, *fp32)
    assert [s["resumed_step"] for s in metrics(run, "start")] == [None, 10]
    assert metrics(run, "start")[0]["amp"] == "fp32"
    assert inspect(run)["params_sha256"] == inspect(straight_run(torchrun2, *fp32))["params_sha256"]


@pytest.fixture(scope="module")
def straight_lm(straight_run):
    return straight_run(torchrun2, *LM)


@pytest.mark.slow
@pytest.mark.e2e
def test_char_lm_with_fp16_and_ema_resumes_a_killed_rank_bitwise_and_its_snapshot_on_one_rank(straight_lm,
                                                                                              tmp_path):
    """The character transformer sharded: a rank SIGKILLed after step 13 and restarted ends equal to the
    straight run, bit for bit (parameters, the EMA model's evaluation, the steps fp16 skipped); the
    straight run's step-10 snapshot, resharded onto one rank, goes on at the same global sample."""
    run = killed(tmp_path / "killed", *LM)
    assert [s["resumed_step"] for s in metrics(run, "start")] == [None, 10]
    ends = [metrics(r, "end")[0] for r in (run, straight_lm)]
    assert ends[0]["skipped_steps"] > 0  # the overflowing first steps were skipped, by every rank at once
    for key in ("skipped_steps", "val_loss", "val_bpc", "final_loss"):
        assert ends[0][key] == ends[1][key], (key, ends)
    assert inspect(run)["params_sha256"] == inspect(straight_lm)["params_sha256"]
    state = torch.load(run / "snapshots" / "step_000000024" / "state.pt", weights_only=False)
    assert state["model"] == state["ema"] == "sharded"  # the EMA copy in the shards, not rank 0's part of it

    one = tmp_path / "one"
    shutil.copytree(straight_lm / "snapshots" / "step_000000010", one / "snapshots" / "step_000000010")
    r = torchrun(1, f"run.dir={one}", *LM, "run.allow_changes=[run.dir]")
    assert r.returncode == 0, r.output[-3000:]
    (start,) = metrics(one, "start")
    before = json.loads((straight_lm / "snapshots" / "step_000000010" / "meta.json").read_text())
    assert (start["resumed_step"], start["resumed_world_size"], start["world_size"]) == (10, 2, 1)
    assert (start["epoch"], start["epoch_sample"]) == (before["epoch"], before["epoch_sample"])
    assert metrics(one, "end")[0]["steps"] == 24


@pytest.mark.slow
@pytest.mark.e2e
def test_asynchronous_shard_writes_publish_every_snapshot_whole_and_a_killed_rank_resumes_bitwise(straight_lm,
                                                                                                 tmp_path):
    """`snapshot.async=true`: every rank's shards written by DCP's thread while training goes on, each
    snapshot published once every rank's are on disk; a rank SIGKILLed after step 13 resumes from the
    newest published one and ends equal to the synchronous straight run."""
    killed(tmp_path, *LM, "snapshot.async=true")
    resumed = [s["resumed_step"] for s in metrics(tmp_path, "start")]
    # step 10's may still be in flight at the kill
    assert resumed[0] is None and resumed[1] in (5, 10), resumed
    assert inspect(tmp_path)["params_sha256"] == inspect(straight_lm)["params_sha256"]
    for step in (15, 20, 24):
        meta = json.loads((tmp_path / "snapshots" / f"step_{step:09d}" / "meta.json").read_text())
        assert sorted(meta["shards"]) == ["shards/.metadata", "shards/__0_0.distcp",
                                          "shards/__1_0.distcp"], meta
    assert not list((tmp_path / "snapshots").glob(".tmp-*"))  # nothing half-written left


@pytest.mark.slow
@pytest.mark.e2e
def test_a_two_rank_snapshot_resumes_on_one_rank_resharded_at_the_same_global_sample(fsdp_straight,
                                                                                     tmp_path):
    (tmp_path / "snapshots").mkdir()
    shutil.copytree(fsdp_straight / "snapshots" / "step_000000010", tmp_path / "snapshots" / "step_000000010")
    r = torchrun(1, f"run.dir={tmp_path}", *FSDP, "run.allow_changes=[run.dir]")
    assert r.returncode == 0, r.output[-3000:]
    (start,) = metrics(tmp_path, "start")
    assert (start["resumed_step"], start["resumed_world_size"], start["world_size"]) == (10, 2, 1)
    before = json.loads((fsdp_straight / "snapshots" / "step_000000010" / "meta.json").read_text())
    assert (start["epoch"], start["epoch_sample"]) == (before["epoch"], before["epoch_sample"])
    assert metrics(tmp_path, "end")[0]["steps"] == 24


@pytest.mark.slow
@pytest.mark.e2e
def test_a_flipped_byte_in_one_shard_is_rejected_in_one_line_and_the_previous_snapshot_is_used(
        fsdp_straight, tmp_path):
    shutil.copytree(fsdp_straight / "snapshots", tmp_path / "snapshots")
    shard = tmp_path / "snapshots" / "step_000000024" / "shards" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = torchrun(2, f"run.dir={tmp_path}", *FSDP, "train.max_steps=30",
                 "run.allow_changes=[run.dir,train.max_steps]")
    assert r.returncode == 0, r.output[-3000:]
    lines = [ln for ln in r.output.splitlines() if "skipping snapshot" in ln]
    assert (len(lines) == 1 and "__1_0.distcp: checksum mismatch" in lines[0]
            and "a corrupt shard" in lines[0]), lines
    assert metrics(tmp_path, "start")[0]["resumed_step"] == 20


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")
@pytest.mark.parametrize("write", ["sync", "async"])
def test_a_full_disk_fails_shard_writes_whole_and_stops_after_max_failures_with_exit_3(tmp_path, mounts,  # noqa: F811
                                                                                         write):
    run_dir = tmp_path / "run"
    snaps = tmpfs(mounts, run_dir / "snapshots", "1200k")  # one sharded SmallCNN snapshot is about 0.93 MB
    r = torchrun(2, f"run.dir={run_dir}", *QUICK, "parallel.strategy=fsdp", "train.epochs=100",
                 "train.max_steps=60", "snapshot.every_steps=10",
                 f"snapshot.async={write == 'async'}".lower())
    # both ranks agreed, exit 3
    assert r.returncode == 1 and r.stderr.count("exitcode: 3") >= 1, r.output[-3000:]
    assert (r.stderr.count("error: snapshot.max_failures=3") == 2
            and "forcefully" not in r.stderr), r.stderr[-3000:]
    failed = metrics(run_dir, "snapshot_failed")
    assert [f["errno"] for f in failed] == ["ENOSPC"] * 3 and [f["in_a_row"] for f in failed] == [1, 2, 3]
    assert inspect(run_dir)["global_step"] == 10  # the newest valid snapshot, every shard intact
    no_leftovers(snaps)


def fsdp_preempt_cmd(run_dir, *args):
    # Parameters gathered in autocast's dtype (bf16 where the CPU has it), BatchNorm units kept fp32. 90
    # steps, a periodic snapshot at 50: the stop, after step 55, lands between it and the end, in less
    # than half the steps of test_preempt.py's run (FSDP's steps cost more).
    return preempt_torchrun_cmd(run_dir, "parallel.strategy=fsdp", "parallel.fsdp_param_dtype=amp",
                                "train.max_steps=90", "snapshot.every_steps=50", *args)


@pytest.mark.slow
@pytest.mark.e2e
def test_sigterm_to_one_fsdp_worker_snapshots_the_step_reached_and_the_rerun_is_bitwise_equal(straight_sha,
                                                                                              tmp_path):
    """The preemption path of test_preempt.py with sharded snapshots (and low-precision gathers): the notice
    reaches rank 1, both ranks stop at the agreed step, every rank writes its shard of that step; zero
    steps redone."""
    run_dir = tmp_path / "run"
    job = Job(fsdp_preempt_cmd(run_dir), tmp_path, "fsdp")
    ranks = job.workers(2)
    job.signal_after(run_dir, "train", 55, ranks[1])
    rec = check_preempted(run_dir, job, None)
    meta = json.loads((run_dir / "snapshots" / f"step_{rec['step']:09d}" / "meta.json").read_text())
    assert sorted(meta["shards"]) == ["shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"]
    rerun_resumes_exactly(run_dir, fsdp_preempt_cmd, rec["step"], straight_sha(fsdp_preempt_cmd))


@pytest.mark.slow
@pytest.mark.e2e
def test_an_fsdp_unit_class_the_model_lacks_is_one_line_naming_the_classes_it_has(tmp_path):
    r = torchrun(2, f"run.dir={tmp_path}", *FSDP, "parallel.fsdp_units=[TransformerBlock]")
    assert r.returncode != 0
    assert "parallel.fsdp_units=['TransformerBlock']: no module of class TransformerBlock" in r.output
    assert "its module classes are" in r.output


def gloo_pair(cmds: list[list[str]]) -> tuple[list[int], list[str]]:
    """The commands of rank 0 and rank 1 of a gloo group on loopback (RANK, MASTER_ADDR and MASTER_PORT
    set), run to their end: (exit codes, outputs)."""
    import subprocess

    from helpers import free_port

    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(rank)}, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for rank, cmd in enumerate(cmds)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], outs


# Two ranks of a gloo group, each its own process: rank 1 in a mount namespace of its own, where a tmpfs
# hides the snapshot directory rank 0 writes (storage local to each node, as on two machines).
_BLIND_RANK = """
import os, sys, torch, torch.distributed as dist
from trainapp.group import DistContext
from trainapp.errors import ConfigError, leave
from trainapp.snapshots.manager import SnapshotManager
from trainapp.snapshots.publish import LocalPublish
rank, root = int(os.environ["RANK"]), sys.argv[1]
dist.init_process_group("gloo", rank=rank, world_size=2)
ctx = DistContext(rank, 0, 2, torch.device("cpu"), "gloo", True)
manager = SnapshotManager(LocalPublish(root, keep=3), every_steps=5)
try:
    manager.save(ctx, 5, {"model": {}} if rank == 0 else None, {"step": 5} if rank == 0 else None, {},
                 shards={"model": {"w": torch.full((4,), float(rank))}})
except ConfigError as e:
    print(f"rank {rank} error: {e}", flush=True)
    leave(2)  # past torch's C++ destructors, one of which sometimes aborts a finished rank (trainapp.errors.leave)
leave(0)
"""  # noqa: E501


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs in a mount namespace: needs root")
def test_snapshot_storage_a_rank_does_not_see_stops_every_rank_in_one_line_before_a_shard_is_written(
        tmp_path):
    root = tmp_path / "snapshots"
    root.mkdir()
    blind = f"mount -t tmpfs tmpfs {root} && exec {PY} -c \"$0\" {root}"
    codes, outs = gloo_pair([[PY, "-c", _BLIND_RANK, str(root)],
                             ["unshare", "--mount", "--propagation", "private", "sh", "-c", blind,
                              _BLIND_RANK]])
    assert codes == [2, 2], outs
    for rank, out in enumerate(outs):
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"rank {rank} error: {root}: not the same directory "
                                                       "on every node (rank 1 on "), out
        assert "point run.dir at a shared filesystem" in lines[0]
    assert list(root.iterdir()) == []  # no shard written, rank 0's empty staging directory removed


# Two gloo ranks shard a small conv net with a BatchNorm and record the dtype each layer's weight has
# while its forward runs (what the unit gathered), then the dtypes of the sharded parameters and gradients.
_GATHER_DTYPES = """
import os, sys, json, torch, torch.distributed as dist
from torch import nn
from trainapp.config import load
from trainapp.core.parallel import fsdp
from trainapp.errors import leave
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
cfg = load(None, ["parallel.strategy=fsdp", f"parallel.fsdp_param_dtype={sys.argv[1]}"])
model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), nn.Flatten(),
                      nn.Linear(4 * 6 * 6, 2))
seen = {}
for name, m in model.named_modules():
    if hasattr(m, "weight"):
        m.register_forward_pre_hook(lambda mod, args, name=name: seen.__setitem__(name, str(mod.weight.dtype)))
fsdp.shard(model, cfg.parallel, dtype=torch.bfloat16)
with torch.autocast("cpu", dtype=torch.bfloat16):
    model(torch.randn(2, 3, 8, 8)).float().sum().backward()
stored = sorted({str(p.dtype) for p in model.parameters()} | {str(p.grad.dtype) for p in model.parameters()})
print(json.dumps({"gathered": seen, "stored": stored}), flush=True)
dist.destroy_process_group()
leave(0)  # past torch's C++ destructors, one of which sometimes aborts a finished rank (trainapp.errors.leave)
"""  # noqa: E501


@pytest.mark.parametrize("mode, conv", [("amp", "torch.bfloat16"), ("fp32", "torch.float32")])
def test_param_dtype_amp_gathers_in_bf16_keeps_batchnorm_and_the_shards_and_grads_fp32(mode, conv):
    codes, outs = gloo_pair([[PY, "-c", _GATHER_DTYPES, mode]] * 2)
    assert codes == [0, 0], outs
    for out in outs:
        got = json.loads(out.strip().splitlines()[-1])
        assert got["gathered"] == {"0.0": conv, "0.1": "torch.float32", "2": conv}, got
        assert got["stored"] == ["torch.float32"], got  # the optimizer steps fp32 shards with fp32 gradients


# Two gloo ranks write one sharded snapshot to a URI store (file:// on a small tmpfs) through Ray's publish
# step, without a Ray cluster: rank 0's shard fits the store, rank 1's does not.
_URI_PUSH = """
import json, os, sys, torch, torch.distributed as dist
from trainapp.errors import leave
from trainapp.group import DistContext
from trainapp.launch.ray.publish import RayPublish
from trainapp.snapshots.manager import SnapshotManager, SnapshotRequest
rank, local, store = int(os.environ["RANK"]), sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2)
ctx = DistContext(rank, 0, 2, torch.device("cpu"), "gloo", True)
manager = SnapshotManager(RayPublish(local, f"file://{store}", False, "run"), every_steps=5)
elements = 1000 if rank == 0 else 400_000  # 4 kB, then 1.6 MB against the store's 1 MB
manager.save(ctx, 5, {"model": "sharded"} if rank == 0 else None, {"step": 5} if rank == 0 else None, {},
             SnapshotRequest(announce=False), shards={"model": {f"w{rank}": torch.full((elements,), float(rank))}})
print(json.dumps({"failed": manager.failed, "left": sorted(os.listdir(local)) if os.path.isdir(local) else []}),
      flush=True)
dist.destroy_process_group()
leave(0)
"""  # noqa: E501


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")
def test_a_shard_upload_that_fails_on_one_rank_to_a_uri_store_fails_the_snapshot_and_leaves_nothing(tmp_path,
                                                                                                   mounts):  # noqa: F811
    store = tmpfs(mounts, tmp_path / "store", "1m")
    codes, outs = gloo_pair([[PY, "-c", _URI_PUSH, str(tmp_path / "local"), str(store)]] * 2)
    assert codes == [0, 0], outs
    got = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    (failed,) = got[0]["failed"]  # rank 0 counted it: rank 1's upload ran out of space
    assert (failed["step"] == 5 and failed["errno"] == "ENOSPC"
            and failed["path"] == f"file://{store}/run/step_000000005")
    assert got[0]["left"] == [] and list(store.rglob("*")) in ([], [store / "run"]), list(store.rglob("*"))
