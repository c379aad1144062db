"""snapshot.async: rank 0 blocks only for the CPU copy; the write runs in the background, atomically."""

from __future__ import annotations

import collections
import os
import signal
import subprocess

import pytest
import torch
from helpers import (FAULT_RUN, PY, QUICK, REPO, exited, inspect, metrics, run_cmd, snapshot_manager,
                     snapshot_state, torchrun2, trainapp, wait_until)

from trainapp.faults.drills import SlowDisk
from trainapp.group import DistContext
from trainapp.snapshots import store as snapshot
from trainapp.snapshots.store import load_state, newest_valid

ALONE = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None,
                    owns_group=False)


def test_the_background_write_holds_a_copy_not_the_live_tensors(tmp_path):
    m = snapshot_manager(tmp_path, async_write=True, disk=SlowDisk(0.3))
    state = snapshot_state(10.0)
    m.save(ALONE, 10, state, {"global_step": 10}, {})
    state["model"]["w"].add_(5.0)  # training goes on mutating in place while the write is in flight
    state["optimizer"]["state"][0]["m"].zero_()
    m.wait()
    loaded = load_state(m.path_for(10))
    assert torch.equal(loaded["model"]["w"], torch.full((1000,), 10.0))
    assert torch.equal(loaded["optimizer"]["state"][0]["m"], torch.ones(3) * 10.0)


def test_save_blocks_for_the_copy_and_the_next_save_waits_for_the_previous_write(tmp_path):
    m = snapshot_manager(tmp_path, async_write=True, disk=SlowDisk(1.0))
    m.save(ALONE, 10, snapshot_state(10.0), {"global_step": 10}, {})
    first = m.last_blocking_s
    assert not m.path_for(10).exists(), "returned before the write finished: it runs in the background"
    m.save(ALONE, 20, snapshot_state(20.0), {"global_step": 20}, {})
    second = m.last_blocking_s
    assert m.path_for(10).exists(), "the second save started before the first write was complete"
    m.wait()
    assert first < 0.5 <= second, (first, second)
    assert [p.name for p in snapshot.list_snapshots(tmp_path)] == ["step_000000010", "step_000000020"]


def test_the_cpu_copy_reuses_the_previous_snapshots_buffers_and_each_snapshot_keeps_its_values(tmp_path):
    m = snapshot_manager(tmp_path, async_write=True)
    state = snapshot_state(10.0)
    state["model"]["conv"] = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)
    m.save(ALONE, 10, state, {"global_step": 10}, {})
    buffer = m._staging["model"]["w"].data_ptr()
    state["model"]["w"].fill_(20.0)
    state["model"]["grown"] = torch.ones(7)
    state["optimizer"]["state"][0]["m"] = torch.ones(5)  # a new shape gets a new buffer
    m.save(ALONE, 20, state, {"global_step": 20}, {})
    m.wait()
    assert m._staging["model"]["w"].data_ptr() == buffer, \
        "the copy went to fresh memory, not the reused buffer"
    assert m._staging["model"]["w"] is not state["model"]["w"]
    first, second = load_state(m.path_for(10)), load_state(m.path_for(20))
    assert torch.equal(first["model"]["w"], torch.full((1000,), 10.0))
    assert torch.equal(second["model"]["w"], torch.full((1000,), 20.0))
    assert torch.equal(second["optimizer"]["state"][0]["m"], torch.ones(5))
    assert torch.equal(second["model"]["grown"], torch.ones(7))
    assert torch.equal(second["model"]["conv"], state["model"]["conv"])
    assert second["model"]["conv"].is_contiguous(memory_format=torch.channels_last)


def test_an_async_snapshot_keeps_the_containers_a_synchronous_one_keeps(tmp_path):
    """A module's state dict (an OrderedDict whose `_metadata` holds the module versions loading migrates
    old keys by) and a task's Counter come back from a background write as from a synchronous one."""
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).state_dict()
    loaded = []
    for async_write in (False, True):
        m = snapshot_manager(tmp_path / str(async_write), async_write=async_write)
        state = {**snapshot_state(1.0), "ema": module, "task": {"seen": collections.Counter(a=3)}}
        m.save(ALONE, 10, state, {"global_step": 10}, {})
        m.wait()
        loaded.append(load_state(m.path_for(10)))
    for got in loaded:
        assert type(got["ema"]) is collections.OrderedDict and got["ema"]._metadata == module._metadata
        assert list(got["ema"]) == list(module) and got["task"]["seen"] == collections.Counter(a=3)
        assert type(got["task"]["seen"]) is collections.Counter


def test_a_failed_background_write_surfaces_in_the_training_thread(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    m = snapshot_manager(blocker, async_write=True)
    m.save(ALONE, 10, snapshot_state(10.0), {"global_step": 10}, {})
    with pytest.raises(OSError):
        m.wait()
    m.wait()  # reported once


@pytest.mark.slow
def test_async_snapshots_change_nothing_in_the_math(torchrun_straight, tmp_path):
    """FAULT_RUN with its snapshots written in the background ends equal to the shared synchronous run."""
    r = run_cmd(torchrun2(tmp_path / "async", *FAULT_RUN, "snapshot.async=true"))
    assert r.returncode == 0, r.output[-3000:]
    a, b = inspect(torchrun_straight), inspect(tmp_path / "async")
    assert a["global_step"] == b["global_step"] == 24
    assert a["params_sha256"] == b["params_sha256"]
    records = metrics(tmp_path / "async", "snapshot")
    assert [r["step"] for r in records] == [5, 10, 15, 20, 24] and all(r["background"] for r in records)


@pytest.mark.e2e
@pytest.mark.slow
def test_sigkill_during_a_background_write_leaves_the_previous_snapshot_intact(tmp_path):
    run_dir = tmp_path / "run"
    args = [f"run.dir={run_dir}", "train.max_steps=30", "snapshot.every_steps=5", "snapshot.async=true",
            "drill.snapshot_write_delay_s=4", *QUICK, "snapshot.memory_every_steps=0"]  # the storage tier
    proc = subprocess.Popen([PY, "-m", "trainapp", "train", *args], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    snaps = run_dir / "snapshots"
    try:
        # A complete step_5 and the state file of step_10 written but not yet completed.
        wait_until(lambda: (snaps / "step_000000005").exists() and [
            p for p in snaps.glob(".tmp-step_000000010-*") if (p / snapshot.STATE).exists()],
            "step 10 mid-write", 120, gone=exited(proc, proc.stderr.read), interval=0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert not (snaps / "step_000000010").exists()
    path, meta = newest_valid(snaps)
    assert path.name == "step_000000005" and meta["global_step"] == 5
    # The run resumes from it, sweeps the leftover and finishes.
    r = trainapp("train", *[a for a in args if not a.startswith("drill.")], timeout=300)
    assert r.returncode == 0, r.output[-3000:]
    assert metrics(run_dir, "start")[-1]["resumed_step"] == 5
    assert inspect(run_dir)["global_step"] == 30
    assert not list(snaps.glob(".tmp-*"))
