"""Storage faults with real faults: a full tmpfs (ENOSPC), a read-only bind mount (EROFS), a directory a
non-root user may not write (EACCES). A failed snapshot never kills training and never leaves anything
half-written; too many in a row, or a failed final snapshot, stop the run with exit 3 and one line."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import PY, QUICK, inspect, metrics, run_cmd, torchrun, trainapp

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0,
                                 reason="mounts a tmpfs and a read-only bind mount: needs root")]

RUN = [*QUICK, "train.epochs=100", "train.max_steps=60", "snapshot.every_steps=10"]


@pytest.fixture
def mounts():
    """Mount points this test made; unmounted at the end, also on failure."""
    made: list[Path] = []
    yield made
    for m in reversed(made):
        subprocess.run(["umount", "-l", str(m)], check=False)


def tmpfs(mounts: list[Path], path: Path, size: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    mounts.append(path)
    return path


def read_only(mounts: list[Path], path: Path) -> Path:
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    mounts.append(path)
    subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True)
    return path


def error_line(r) -> str:
    lines = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output[-3000:]
    return lines[0]


def no_leftovers(snaps: Path) -> None:
    assert not [p.name for p in snaps.iterdir() if p.name.startswith(".")], list(snaps.iterdir())


def test_a_full_disk_with_room_for_two_snapshots_deletes_older_ones_and_the_run_finishes(tmp_path, mounts):
    straight = tmp_path / "straight"
    r = trainapp("train", f"run.dir={straight}", *RUN)
    assert r.returncode == 0, r.output[-3000:]
    run_dir = tmp_path / "run"
    # a SmallCNN snapshot is about 0.8 MB; keep=3 needs 2.4
    snaps = tmpfs(mounts, run_dir / "snapshots", "2m")
    r = trainapp("train", f"run.dir={run_dir}", *RUN)
    assert r.returncode == 0, r.output[-3000:]
    assert "deleted older snapshots to make room, writing it again" in r.stderr
    assert not metrics(run_dir, "snapshot_failed")  # every retry succeeded
    assert [s["step"] for s in metrics(run_dir, "snapshot")] == [10, 20, 30, 40, 50, 60]
    final = inspect(run_dir)
    assert final["global_step"] == 60 and final["params_sha256"] == inspect(straight)["params_sha256"]
    no_leftovers(snaps)


@pytest.mark.parametrize("launcher", ["alone", "torchrun"])
def test_a_full_disk_with_room_for_one_stops_after_max_failures_with_exit_3(tmp_path, mounts, launcher):
    run_dir = tmp_path / "run"
    snaps = tmpfs(mounts, run_dir / "snapshots", "1200k")
    args = [f"run.dir={run_dir}", *RUN]
    if launcher == "alone":
        r = trainapp("train", *args, "snapshot.async=true")
    else:
        r = torchrun(2, *args)
    assert r.returncode == (3 if launcher == "alone" else 1), r.output[-3000:]
    if launcher == "torchrun":  # both ranks agreed and exited 3, none hung in a collective
        assert r.stderr.count("exitcode: 3") >= 1 and "forcefully" not in r.stderr, r.stderr[-3000:]
        assert r.stderr.count("error: snapshot.max_failures=3") == 2, r.stderr[-3000:]
    else:
        line = error_line(r)
        assert ("snapshot.max_failures=3: 3 snapshots in a row failed" in line
                and "No space left on device" in line)
        assert (f"free space under {snaps}" in line
                and f"newest valid snapshot is {snaps}/step_000000010" in line)
    failed = metrics(run_dir, "snapshot_failed")
    assert [f["errno"] for f in failed] == ["ENOSPC"] * 3 and [f["in_a_row"] for f in failed] == [1, 2, 3]
    assert inspect(run_dir)["global_step"] == 10  # the newest valid snapshot is intact
    no_leftovers(snaps)


def test_a_full_disk_is_known_when_torchs_writer_drops_the_errno(tmp_path, mounts):
    """torch.distributed.checkpoint writes shards through torch's own file writer, which reports a full
    disk as a RuntimeError about its zip position: the OSError only as the exception it was handling,
    and not at all once DCP has carried the error to another rank, pickled. The snapshot manager still
    knows it for ENOSPC (a failed snapshot, training goes on): by the errors' graph, else by the full
    filesystem. The same RuntimeError on a filesystem with room is no storage error: a bug ends the run."""
    import errno
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from trainapp.snapshots.manager import _storage_cause

    full = tmpfs(mounts, tmp_path / "full", "256k")
    with pytest.raises(dcp.api.CheckpointException) as caught:
        dcp.save({"a": torch.zeros(20_000), "b": torch.zeros(80_000)},
                 storage_writer=dcp.FileSystemWriter(str(full / "shards")), no_dist=True)
    seen = _storage_cause(caught.value)
    assert seen is not None and seen.errno == errno.ENOSPC, caught.value
    (failure,) = caught.value.failures.values()
    raised = failure[0] if isinstance(failure, tuple) else failure
    carried = pickle.loads(pickle.dumps(raised))
    assert isinstance(carried, RuntimeError) and carried.__context__ is None
    assert _storage_cause(carried) is None
    known = _storage_cause(carried, full / "shards")
    assert known is not None and known.errno == errno.ENOSPC and "torch's writer said" in str(known), known
    assert _storage_cause(carried, tmp_path) is None


@pytest.mark.e2e
def test_a_read_only_run_dir_fails_the_final_snapshot_with_exit_3_and_keeps_the_old_one(tmp_path, mounts):
    run_dir = tmp_path / "run"
    r = trainapp("train", f"run.dir={run_dir}", *QUICK, "train.max_steps=20", "snapshot.every_steps=0")
    assert r.returncode == 0, r.output[-3000:]
    snaps = read_only(mounts, run_dir / "snapshots")
    r = trainapp("train", f"run.dir={run_dir}", *QUICK, "train.max_steps=40", "snapshot.every_steps=0")
    assert r.returncode == 3, r.output[-3000:]
    line = error_line(r)
    assert "the final snapshot (step 40) failed" in line and "Read-only file system" in line, line
    assert "read-only filesystem: remount it read-write" in line and "step_000000020" in line, line
    assert metrics(run_dir, "start")[-1]["resumed_step"] == 20  # reading still worked
    # a run never reports success without its final snapshot: the only `end` is the first run's
    assert [e["steps"] for e in metrics(run_dir, "end")] == [20]
    assert inspect(run_dir)["global_step"] == 20
    no_leftovers(snaps)


# The capabilities that let root write where a directory's owner and mode say no: without them, root is
# refused like any other uid, and the run still reads the checkout (root owns it), wherever it lives.
DAC_CAPS = "-dac_override,-dac_read_search,-fowner"


def test_a_directory_without_write_permission_stops_the_run_with_exit_3(tmp_path):
    """As root without CAP_DAC_OVERRIDE (a container with its capabilities dropped): the run dir is root's,
    the snapshots dir belongs to uid 65534 (0755). No second uid has to reach the checkout, so the test
    passes from a private (0700) clone."""
    run_dir = tmp_path / "run"
    (run_dir / "snapshots").mkdir(parents=True)
    shutil.chown(run_dir / "snapshots", 65534, 65534)
    os.chmod(run_dir / "snapshots", 0o755)
    r = run_cmd(["setpriv", f"--inh-caps={DAC_CAPS}", f"--bounding-set={DAC_CAPS}", PY, "-m", "trainapp",
                 "train", f"run.dir={run_dir}", *RUN])
    assert r.returncode == 3, r.output[-3000:]
    line = error_line(r)
    assert "Permission denied" in line and "uid 0 without CAP_DAC_OVERRIDE may not write there" in line, line
    assert "there is no valid snapshot yet" in line, line
    assert [f["errno"] for f in metrics(run_dir, "snapshot_failed")] == ["EACCES"] * 3
    assert list((run_dir / "snapshots").iterdir()) == []
