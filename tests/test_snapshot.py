import errno
import fcntl
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import QUICK, inspect, metrics, snapshot_manager, snapshot_state, trainapp

from trainapp.config import ConfigError
from trainapp.snapshots import files
from trainapp.snapshots import store as snapshot
from trainapp.snapshots.manager import SnapshotManager
from trainapp.snapshots.publish import LocalPublish
from trainapp.snapshots.store import newest_valid, params_sha256, verify


def test_manager_owns_the_cadence(tmp_path):
    m = snapshot_manager(tmp_path / "snapshots")
    assert [s for s in range(1, 35) if m.due(s, last=False)] == [10, 20, 30]
    assert m.due(7, last=True)
    assert not SnapshotManager(LocalPublish(tmp_path, 1), every_steps=0).due(10, last=False)


def test_write_is_complete_and_leaves_no_temporary_files(tmp_path):
    m = snapshot_manager(tmp_path / "snapshots")
    path = m.write(10, snapshot_state(10), {"global_step": 10})
    assert sorted(p.name for p in path.iterdir()) == [snapshot.META, snapshot.STATE]
    meta = verify(path)
    assert meta["global_step"] == 10 and meta["bytes"] == (path / snapshot.STATE).stat().st_size
    assert [p.name for p in m.root.iterdir()] == ["step_000000010"]


def test_save_and_purge_keeps_last_k_snapshots(tmp_path):
    m = snapshot_manager(tmp_path / "snapshots", keep=2)
    for step in (10, 20, 30, 40):
        m.write(step, snapshot_state(step), {"global_step": step})
    assert [p.name for p in snapshot.list_snapshots(m.root)] == ["step_000000030", "step_000000040"]


def test_corrupt_newest_snapshot_falls_back_to_the_previous_one(tmp_path, caplog):
    m = snapshot_manager(tmp_path / "snapshots")
    for step in (10, 20):
        m.write(step, snapshot_state(step), {"global_step": step})
    newest = m.path_for(20) / snapshot.STATE
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="trainapp"):
        path, meta = newest_valid(m.root)
    assert path == m.path_for(10) and meta["global_step"] == 10
    assert "checksum mismatch" in caplog.text and "step_000000020" in caplog.text


def test_truncated_newest_snapshot_falls_back(tmp_path):
    m = snapshot_manager(tmp_path / "snapshots")
    for step in (10, 20):
        m.write(step, snapshot_state(step), {"global_step": step})
    newest = m.path_for(20) / snapshot.STATE
    newest.write_bytes(newest.read_bytes()[:100])
    assert newest_valid(m.root)[0] == m.path_for(10)


def test_snapshot_without_its_meta_record_is_incomplete(tmp_path):
    m = snapshot_manager(tmp_path / "snapshots")
    m.write(10, snapshot_state(10), {"global_step": 10})
    m.write(20, snapshot_state(20), {"global_step": 20})
    (m.path_for(20) / snapshot.META).unlink()
    assert newest_valid(m.root)[0] == m.path_for(10)


def test_no_valid_snapshot_at_all_is_an_error_not_a_silent_restart(tmp_path):
    m = snapshot_manager(tmp_path / "snapshots")
    m.write(10, snapshot_state(10), {"global_step": 10})
    (m.path_for(10) / snapshot.STATE).write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="none is valid"):
        newest_valid(m.root)


def test_a_write_that_dies_midway_leaves_the_previous_snapshot_intact(tmp_path, monkeypatch):
    m = snapshot_manager(tmp_path / "snapshots")
    m.write(10, snapshot_state(10), {"global_step": 10})

    def dying_save(obj, f):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(snapshot.torch, "save", dying_save)
    with pytest.raises(OSError):
        m.write(20, snapshot_state(20), {"global_step": 20})
    monkeypatch.undo()
    assert not m.path_for(20).exists() and not list(m.root.glob(".tmp-*"))
    assert newest_valid(m.root)[0] == m.path_for(10)


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_state_files_are_whole_at_every_size_on_direct_and_buffered_filesystems(tmp_path, where):
    """O_DIRECT writes go out in aligned chunks with the tail padded and cut back; tmpfs refuses
    O_DIRECT and gets the buffered write. Sizes straddle the block and the chunk."""
    import tempfile

    if where == "tmpfs" and not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    root = Path(tempfile.mkdtemp(dir="/dev/shm")) if where == "tmpfs" else tmp_path
    try:
        chunk = files.Buffers.CHUNK
        for n in (1, 4095, 4096, 4097, chunk - 7, chunk + 5000, 2 * chunk + 1):
            state = {"model": {"w": torch.arange(n, dtype=torch.uint8)}, "progress": {"n": n}}
            digest, size = files.save_state(root / f"s{n}", state)
            assert (root / f"s{n}").stat().st_size == size
            assert files.file_digest(root / f"s{n}") == digest
            back = torch.load(root / f"s{n}", weights_only=True)
            assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["progress"] == {"n": n}
    finally:
        if where == "tmpfs":
            shutil.rmtree(root)


def test_a_filesystem_that_refuses_direct_writes_midway_gets_a_buffered_one(tmp_path, monkeypatch):
    real_write = os.write

    def refusing(fd, data):
        if os.get_blocking(fd) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(files.os, "write", refusing)
    state = {"model": {"w": torch.randn(10_000)}}
    digest, size = files.save_state(tmp_path / "s", state)
    assert files.file_digest(tmp_path / "s") == digest and (tmp_path / "s").stat().st_size == size
    assert torch.equal(torch.load(tmp_path / "s", weights_only=True)["model"]["w"], state["model"]["w"])


def test_format_1_snapshots_with_a_sha256_still_verify_and_corruption_is_still_caught(tmp_path):
    m = snapshot_manager(tmp_path / "snapshots")
    path = m.write(10, snapshot_state(10), {"global_step": 10})
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == 2 and meta["xxh3_128"] == files.file_digest(path / "state.pt")
    old = {k: v for k, v in meta.items() if k != "xxh3_128"}
    old.update(format=1, sha256=files.file_digest(path / "state.pt", "sha256"))
    (path / "meta.json").write_text(json.dumps(old))
    assert verify(path)["global_step"] == 10
    data = bytearray((path / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "state.pt").write_bytes(bytes(data))
    with pytest.raises(snapshot.SnapshotError, match="checksum mismatch .sha256"):
        verify(path)


def test_leftovers_of_a_killed_writer_are_swept_by_the_next_write(tmp_path):
    m = snapshot_manager(tmp_path / "snapshots")
    leftover = m.root / ".tmp-step_000000020-99999"
    leftover.mkdir(parents=True)
    (leftover / snapshot.STATE).write_bytes(b"half")
    m.write(30, snapshot_state(30), {"global_step": 30})
    assert not leftover.exists() and newest_valid(m.root)[0] == m.path_for(30)


def test_rewriting_the_same_step_replaces_it_atomically(tmp_path):
    m = snapshot_manager(tmp_path / "snapshots")
    m.write(10, snapshot_state(10), {"global_step": 10, "tag": "old"})
    m.write(10, snapshot_state(10), {"global_step": 10, "tag": "new"})
    assert verify(m.path_for(10))["tag"] == "new"
    assert [p.name for p in m.root.iterdir()] == ["step_000000010"]


def test_params_sha256_covers_parameters_and_buffers():
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    h0 = params_sha256(net)
    assert h0 == params_sha256(net)
    net[1].running_mean += 1  # a buffer
    h1 = params_sha256(net)
    with torch.no_grad():
        net[0].weight[0, 0] += 1e-7  # the smallest change counts
    assert len({h0, h1, params_sha256(net)}) == 3


@pytest.mark.slow
def test_inspect_reports_the_newest_snapshot_of_a_run(run_dir):
    r = trainapp("train", f"run.dir={run_dir}", "train.max_steps=12", "snapshot.every_steps=5", *QUICK)
    assert r.returncode == 0, r.output
    by_run = inspect(run_dir)
    assert by_run["global_step"] == 12 and by_run["world_size"] == 1 and by_run["epoch"] == 0
    assert len(by_run["params_sha256"]) == 64
    assert (by_run["task"], by_run["model"]) == ("image_classification", "smallcnn")
    snaps = snapshot.list_snapshots(run_dir / "snapshots")
    assert [p.name for p in snaps] == ["step_000000005", "step_000000010", "step_000000012"]
    by_file = inspect(snaps[1] / snapshot.STATE)
    assert by_file["global_step"] == 10 and by_file["params_sha256"] != by_run["params_sha256"]
    assert inspect(run_dir / "snapshots")["global_step"] == 12
    # The hash inspect computes is the one the trainer recorded when it saved.
    assert json.loads((snaps[-1] / snapshot.META).read_text())["params_sha256"] == by_run["params_sha256"]


@pytest.mark.slow
def test_training_resumes_from_the_previous_snapshot_when_the_newest_is_corrupt(run_dir):
    args = [f"run.dir={run_dir}", "snapshot.every_steps=5", "snapshot.keep=3", *QUICK]
    assert trainapp("train", "train.max_steps=10", *args).returncode == 0
    newest = run_dir / "snapshots" / "step_000000010" / snapshot.STATE
    newest.write_bytes(newest.read_bytes()[:-64])  # truncated
    r = trainapp("train", "train.max_steps=15", *args)
    assert r.returncode == 0, r.output
    assert "step_000000010" in r.stderr and "truncated" in r.stderr
    start = metrics(run_dir, "start")[-1]
    assert start["resumed_step"] == 5 and start["resumed_from"].endswith("step_000000005")
    assert inspect(run_dir)["global_step"] == 15
