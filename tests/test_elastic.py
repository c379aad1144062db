"""Elastic runs keep their math (trainapp/core/layout.py): the same global batch, cut into the same
micro-batches with the same randomness at every world size, every sample of an epoch trained exactly
once across resizes. A user's task whose items carry their index writes the sample ledger
(tests/usertasks/usertasks_ledger.py). The Ray case (a node lost, then back) is in test_ray.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
import usertasks_ledger
import usertasks_stream
from helpers import (RDZV_CONF, REPO, TORCHRUN, USERTASKS, inspect, metrics, torchrun, trainapp,
                     wait_for_record)

from helpers import free_port
from trainapp.snapshots.store import list_snapshots

pytestmark = pytest.mark.slow

LEDGER = ["task.name=usertasks_ledger:Ledger", "train.batch_size=16", "amp.dtype=off", "train.progress=false"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(USERTASKS), os.environ.get("PYTHONPATH", "")])}


def _params(run_dir) -> dict[str, torch.Tensor]:
    newest = list_snapshots(run_dir / "snapshots")[-1]
    state = torch.load(newest / "state.pt", weights_only=False)["model"]
    return {k: v.double() for k, v in state.items() if v.is_floating_point() and "running" not in k}


def rel_distance(a: dict, b: dict) -> float:
    return (sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5
            / sum((a[k] ** 2).sum() for k in a) ** 0.5).item()


def _draws(run_dir) -> dict[tuple, float]:
    """What each micro-batch (step, its samples) drew from torch's generator after its forward pass."""
    return {(line["step"], tuple(line["indices"])): line["draw"] for line in usertasks_ledger.read(run_dir)}


def test_one_rank_with_accumulation_computes_what_two_ranks_with_an_uneven_split_do(tmp_path):
    """Dropout and BatchNorm in the model; a global batch of 3 micro-batches: two ranks split it unevenly
    (rank 0 runs two micro-batches, rank 1 one), one rank runs all three. The micro-batches and their
    random draws follow the slot, so both are the same run up to the order of float sums (the even
    split: test_torchrun_agents_leaving_and_returning_...)."""
    runs = {}
    for procs in (2, 1):
        runs[procs] = tmp_path / f"ranks{procs}"
        args = [f"run.dir={runs[procs]}", *LEDGER, "train.epochs=2", "task.args.rows=480",
                "train.global_batch=48"]
        r = torchrun(procs, *args, env=ENV) if procs > 1 else trainapp("train", *args, env=ENV)
        assert r.returncode == 0, r.output[-3000:]
    layout = metrics(runs[2], "start")[0]["layout"]
    assert layout["micro_steps"] == [2, 1] and layout["even"] is False
    # The same samples in each micro-batch of each step, and the same random draws in it.
    assert _draws(runs[2]) == _draws(runs[1]) and len(_draws(runs[1])) == 2 * (480 // 48) * 3
    assert rel_distance(_params(runs[2]), _params(runs[1])) < 1e-5
    for run in runs.values():
        ledger = usertasks_ledger.check(run, 480, 48)
        assert not ledger["bad_steps"] and ledger["redone"] == 0, ledger
        assert all(c["duplicates"] == c["missing"] == 0 for c in ledger["epochs"].values()), ledger


def _agent(port: int, run_dir, *args: str) -> subprocess.Popen:
    """One torchrun agent: a 'node' of an elastic job of 1 to 2 nodes on loopback."""
    cmd = [TORCHRUN, "--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=ledger", RDZV_CONF, "--max-restarts=4",
           "-m", "trainapp", "train", f"run.dir={run_dir}", *args]
    # Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE, a returning node waits for MASTER_ADDR in the new round
    # and fails after 60 s: torch 2.14's agent that was rank 0 before reuses its store and never
    # publishes the address again (docs/elastic.md).
    # TMPDIR: an agent stopped by a signal leaves its log folder (tempfile's torchelastic_*) behind.
    env = {**ENV, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "TMPDIR": str(run_dir.parent)}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


@pytest.mark.parametrize("data", [pytest.param("map-style", marks=pytest.mark.e2e),
                                  pytest.param("stream", marks=pytest.mark.long)])
def test_torchrun_agents_leaving_and_returning_resize_2_1_2_and_train_every_sample_once(tmp_path, data):
    """Two torchrun agents (`--nnodes=1:2`, c10d rendezvous): the second is preempted (SIGTERM: its
    worker and the peer snapshot the agreed step), the first goes on alone with two micro-batches a
    step; the second comes back, the first agent's membership change stops its worker the same way, and
    the two train on together. The global batch never changes, no step is redone, and the ledger shows
    every sample of every epoch trained exactly once: of a map-style dataset, and of a stream of 8 JSON
    Lines shards (its 2 lanes move between the ranks; tests/test_stream.py has the re-deal)."""
    run_dir, port, rows, gb = tmp_path / "run", free_port(), 1024, 32
    task = LEDGER if data == "map-style" else ["task.name=usertasks_stream:StreamLedger", *LEDGER[1:]]
    args = [*task, f"task.args.rows={rows}", "task.args.step_s=0.05", "train.epochs=10",
            "train.max_steps=160", "train.log_every=1", "snapshot.every_steps=50"]
    agents = [_agent(port, run_dir, *args)]
    try:
        time.sleep(1)  # the first agent hosts the rendezvous store
        agents.append(_agent(port, run_dir, *args))
        wait_for_record(run_dir, "train", lambda r: r["world_size"] == 2 and r["step"] >= 10)
        agents[1].send_signal(signal.SIGTERM)  # the node is preempted
        agents[1].communicate(timeout=60)
        wait_for_record(run_dir, "train", lambda r: r["world_size"] == 1)
        time.sleep(4)
        agents[1] = _agent(port, run_dir, *args)  # back
        wait_for_record(run_dir, "train", lambda r: r["world_size"] == 2 and r["step"] > 40)
        outs = [a.communicate(timeout=300)[0] for a in agents]
        assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outs)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    starts, preempted = metrics(run_dir, "start"), metrics(run_dir, "preempted")
    assert [s["world_size"] for s in starts] == [2, 1, 2], starts
    assert {s["global_batch"] for s in starts} == {gb} and starts[1]["layout"]["micro_steps"] == [2]
    # Each resize resumed from the step the notice snapshotted: none redone.
    assert [s["resumed_step"] for s in starts[1:]] == [p["step"] for p in preempted][-2:], (starts, preempted)
    if data == "stream":  # equal shards, 2 lanes of 512 items: every epoch is 32 whole steps
        ledger = usertasks_stream.epochs_once(run_dir, rows, 32)
        assert ledger == {"steps": list(range(1, 161)), "sizes": {gb}, "bad_epochs": []}, ledger
    else:
        ledger = usertasks_ledger.check(run_dir, rows, gb)
        assert ledger["world_sizes"] == [1, 2] and ledger["steps"] == 160 and ledger["redone"] == 0, ledger
        assert not ledger["bad_steps"], ledger
        for epoch, counts in ledger["epochs"].items():
            assert counts["duplicates"] == counts["missing"] == counts["foreign"] == 0, (epoch, counts)
    assert inspect(run_dir)["global_step"] == 160
