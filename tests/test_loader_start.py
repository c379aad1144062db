"""A DataLoader worker deadlocked in its fork (CPython gh-112275, Python 3.11 and older) is killed and
the loader's workers started again (trainapp/core/loader_start.py): the run ends as its straight twin,
and no worker outlives it (the fault is the real one, made at a chosen fork by
tests/fork_deadlock/sitecustomize.py). A signal to a forked child is no preemption notice to its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers import PY, USERTASKS, inspect, run_cmd, trainapp

FAULT = Path(__file__).parent / "fork_deadlock"
TASK = ["task.name=usertasks_stream:StreamLedger", "train.batch_size=16", "amp.dtype=off",
        "train.progress=false", "task.args.rows=256", "task.args.shards=4", "train.epochs=2",
        "train.max_steps=100", "data.num_workers=2", "snapshot.every_steps=0", "fault.hang_timeout_s=60"]
"""One process, a stream read by 2 loader workers for 2 epochs: its loaders fork 2 workers per epoch and
per evaluation."""


RUN = uuid.uuid4().hex
"""TRAINAPP_TEST_RUN in the environment of every process this file starts: what `_reap_left_behind` looks
for, so that a second suite on the machine, with processes of its own under the same fault, is never
taken for this one's."""


def _env(at: int) -> dict[str, str]:
    path = os.pathsep.join([str(FAULT), str(USERTASKS), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "FORK_DEADLOCK_AT": str(at), "HF_DATASETS_OFFLINE": "1",
            "TRAINAPP_TEST_RUN": RUN}


def _fault_deadlocks() -> bool:
    """Whether the fault deadlocks a child on this Python: a fork with the lock held, the child given 3 s."""
    probe = ("import os, time\npid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
             "for _ in range(300):\n    if os.waitpid(pid, os.WNOHANG)[0]:\n        raise SystemExit(0)\n"
             "    time.sleep(0.01)\nos.kill(pid, 9)\nos.waitpid(pid, 0)\nraise SystemExit(7)\n")
    env = {**os.environ, **_env(1)}
    return subprocess.run([PY, "-c", probe], env=env, timeout=60).returncode == 7


def _reap_left_behind() -> list[int]:
    """Processes of this file's faulted runs still alive (the runs and their workers), SIGKILLed."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                env = (d / "environ").read_bytes().split(b"\0")
                if f"TRAINAPP_TEST_RUN={RUN}".encode() in env and b"FORK_DEADLOCK_AT=3" in env:
                    os.kill(int(d.name), signal.SIGKILL)
                    pids.append(int(d.name))
            except OSError:  # gone meanwhile
                continue
    return pids


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the fault is made with Python 3.11's layout")
def test_a_loader_worker_deadlocked_in_its_fork_is_started_again_and_the_run_ends_as_its_twin(tmp_path):
    if not _fault_deadlocks():
        pytest.skip("this Python has CPython gh-112275's fix: a fork no longer deadlocks on a held HEAD_LOCK")
    straight = trainapp("train", f"run.dir={tmp_path / 'straight'}", *TASK, env=_env(0))
    assert straight.returncode == 0, straight.output[-3000:]
    # The 3rd fork: the first worker of the first evaluation or of epoch 1, whichever comes first.
    # A fresh interpreter: the fault is installed at its start (tests/fork_deadlock/sitecustomize.py).
    r = trainapp("train", f"run.dir={tmp_path / 'faulted'}", *TASK, "data.worker_start_s=3", env=_env(3),
                 fresh=True)
    left = _reap_left_behind()
    assert r.returncode == 0, r.output[-3000:]
    warned = [line for line in r.output.splitlines() if "did not start in data.worker_start_s=3 s" in line]
    assert len(warned) == 1 and "[0]" in warned[0], r.output[-3000:]
    assert not left, f"processes left behind by the run: {left}"
    assert inspect(tmp_path / "faulted")["params_sha256"] == inspect(tmp_path / "straight")["params_sha256"]


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the fault is made with Python 3.11's layout")
def test_a_rank_the_hang_watchdog_ends_leaves_no_loader_worker_behind(tmp_path):
    """The same stuck worker, with the loader told to wait for it far longer than the hang watchdog: the
    watchdog ends the rank (exit 124), and the worker, whose own code never runs and so never sees its
    parent go, ends with it instead of holding the rank's pipes as an orphan (trainapp/errors.py's
    `leave`)."""
    if not _fault_deadlocks():
        pytest.skip("this Python has CPython gh-112275's fix: a fork no longer deadlocks on a held HEAD_LOCK")
    r = trainapp("train", f"run.dir={tmp_path / 'hung'}", *TASK, "data.worker_start_s=600",
                 "fault.hang_timeout_s=3", env=_env(3), timeout=120, fresh=True)
    left = _reap_left_behind()
    assert r.returncode == 124, r.output[-3000:]
    assert "hang: no progress" in r.output, r.output[-3000:]
    assert not left, f"processes left behind by the run: {left}"


FORKED_CHILD_SCRIPT = """
import multiprocessing, os, signal, time
from trainapp.faults.heartbeat import Heartbeat
from trainapp.faults.preempt import Notices

def wait(started):
    started.set()  # after the child's after-fork hooks, which run before any of its Python code
    time.sleep(30)


notices = Notices(Heartbeat(), lambda *a: None)
notices.heartbeat.phase = "compute"
assert notices.install([], 25, lambda signum, frame: notices.handle(signum))
fork = multiprocessing.get_context("fork")
started = fork.Event()
child = fork.Process(target=wait, args=(started,))
child.start()
assert started.wait(30)
os.kill(child.pid, signal.SIGTERM)
child.join(10)
time.sleep(1)  # the watcher thread would have read a byte the child wrote to the shared pipe
print("child", child.exitcode, "notice", notices.signum, flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # the control: a signal to this process is a notice
deadline = time.monotonic() + 10
while not notices.signum and time.monotonic() < deadline:
    time.sleep(0.05)
print("self notice", notices.signum, flush=True)
"""


def test_a_signal_to_a_forked_child_is_no_notice_to_its_parent():
    """A DataLoader worker is forked from the training process and inherits its signal handlers and the
    notice watcher's wakeup pipe; torch ends a worker that does not stop in time with SIGTERM. The child
    ends by that signal as a process without trainapp would, and the parent takes no notice; a signal to
    the parent itself still is one."""
    r = run_cmd([PY, "-c", FORKED_CHILD_SCRIPT], timeout=60)
    assert r.returncode == 0, r.output[-2000:]
    assert f"child -{int(signal.SIGTERM)} notice 0" in r.stdout, r.output[-2000:]
    assert f"self notice {int(signal.SIGTERM)}" in r.stdout, r.output[-2000:]
