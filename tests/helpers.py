"""Helpers that start real training processes and always clean them up."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import forked
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools.local_ray import free_port  # noqa: F401  (the tests' one way to a free loopback port)
from trainapp.observe.metrics import read as metrics  # noqa: F401  (the tests' name for the one reader)
from trainapp.snapshots.memory import AUTO_PROBES

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / ".venv-tools" / "bin"
"""The static checkers' venv (`make tools`): hadolint, checkov, yamllint, kubernetes-validate, ruff."""
USERTASKS = REPO / "tests" / "usertasks"
"""Tasks a user might write (trainapp's tests import them: the sample ledger's checker)."""
sys.path.insert(0, str(USERTASKS))
PY = sys.executable
TORCHRUN = str(Path(PY).with_name("torchrun"))

# The c10d rendezvous of the multi-node torchrun tests (tests/test_elastic.py, test_memory.py): a round
# waits 2 s for more nodes, and an agent that left (preempted or lost) is dropped after 3 missed 1 s
# keep-alives instead of torch's 5 s x 3 (docs/elastic.md: its restart 9 s instead of 21 s here).
RDZV_CONF = "--rdzv-conf=last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
# Small, fast settings shared by the process-level tests.
QUICK = ["train.progress=false", "train.log_every=5", "data.train_size=1024", "data.val_size=256"]
# A run that exercises every stateful part (accumulation, EMA, evaluation, snapshots every 5 steps), for
# the resume tests and the shared restarted run (conftest.py's `torchrun_restarted`).
FAULT_RUN = ["train.max_steps=24", "train.epochs=10", "snapshot.every_steps=5", "train.grad_accum=2",
             "train.ema_decay=0.9", "train.eval_every=10", *QUICK, "snapshot.memory_every_steps=0"]
"""... resumed by the storage tier (its snapshots every 5 steps): tests/test_memory.py turns the memory tier
on over it."""
# The same under FSDP (sharded snapshots): conftest.py's `fsdp_straight`, tests/test_fsdp.py.
FSDP_RUN = [*FAULT_RUN, "parallel.strategy=fsdp", "snapshot.keep=10"]
# The per-rank timing tests' run: 40 steps, a record every 5, a snapshot every 20 (conftest.py's
# `slowed_run`).
RANKS_RUN = ["train.max_steps=40", "train.epochs=20", "snapshot.every_steps=20", *QUICK]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@functools.cache
def render_overlay(overlay: str) -> str:
    """`kubectl kustomize` of k8s/overlays/OVERLAY as `make k8s-render-kind` does it (once per process);
    the test is skipped where kubectl is missing."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip(f"kubectl is missing: k8s/overlays/{overlay} cannot be rendered")
    r = subprocess.run([kubectl, "kustomize", "--load-restrictor=LoadRestrictionsNone",
                        f"k8s/overlays/{overlay}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def tool(name: str) -> Path:
    """A static checker of `make tools`; the test is skipped, saying how to get it, where it is missing."""
    import pytest

    path = TOOLS / name
    if not os.access(path, os.X_OK):
        pytest.skip(f"{path} is missing (make tools installs it)")
    return path


def communicate(proc: subprocess.Popen, timeout: float, what: str) -> tuple[str, str]:
    """(stdout, stderr) of PROC, started in a session of its own; past `timeout`, that session SIGKILLed
    and an AssertionError saying `what`, with the ends of the output."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = end_session(proc)
        raise AssertionError(f"{what}\n{(out or '')[-4000:]}\n{(err or '')[-3000:]}") from None


def end_session(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGKILL the session of PROC (started in a session of its own) now; (stdout, stderr) it wrote."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()


def _cmd_env(env: dict | None) -> dict[str, str]:
    """What a test's command runs with: this process's environment, one intra-op thread, unbuffered output."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}


def _forkable(cmd: list[str]) -> tuple[str, list[str]] | None:
    """The module and arguments of a command that can be forked from this process, if it is one."""
    if cmd[:3] == [PY, "-m", "trainapp"]:
        return "trainapp", cmd[3:]
    if cmd[:1] == [TORCHRUN]:
        return "torch.distributed.run", cmd[1:]
    return None


def run_cmd(cmd: list[str], timeout: float = 300, env: dict | None = None, fresh: bool = False) -> Result:
    """Run `cmd` in its own session; on timeout or error, SIGKILL exactly that process group.
    `python -m trainapp ...` and `torchrun ...` are forked from this process (tests/forked.py: torch
    imported once; torchrun's ranks are fresh interpreters still), unless `fresh` (a test of start-up)
    or a fork of this process could not train (`forked.usable`)."""
    forkable = _forkable(cmd)
    if forkable and not fresh and forked.usable():
        return Result(*forked.run(*forkable, _cmd_env(env), timeout))
    proc = subprocess.Popen(cmd, cwd=REPO, env=_cmd_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = communicate(proc, timeout, f"timed out after {timeout}s: {' '.join(cmd)}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of our own session only
        except ProcessLookupError:
            pass
    return Result(proc.returncode, out, err)


def one_error_line(r: Result, command: str, needle: str, code: int = 2) -> str:
    """trainapp's one-line error of `command` in `r`: exit `code`, the line (`trainapp COMMAND: error:
    ...` holding `needle`) exactly once, no traceback. Other lines are not counted: a cluster's daemons
    (Ray's GCS, gRPC) write native error lines of their own that say nothing about trainapp's line.
    `ray job submit` shows a job's last lines twice (streamed, then in its status): count distinct ones."""
    out = r.output
    mine = [line for line in out.splitlines() if line.startswith(f"trainapp {command}: error:")]
    distinct = set(mine) if "Job '" in out else mine
    assert r.returncode == code, (r.returncode, out[-3000:])
    assert len(distinct) == 1 and needle in mine[0], (needle, mine, out[-3000:])
    assert "Traceback" not in out, out[-3000:]
    return mine[0]


def trainapp(*args: str, timeout: float = 300, env: dict | None = None, fresh: bool = False) -> Result:
    return run_cmd([PY, "-m", "trainapp", *args], timeout=timeout, env=env, fresh=fresh)


def torchrun_cmd(nproc: int, *args: str, max_restarts: int = 0) -> list[str]:
    """`torchrun ... -m trainapp train ARGS` on this machine."""
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
            "-m", "trainapp", "train", *args]


def torchrun(nproc: int, *args: str, max_restarts: int = 0, timeout: float = 300,
             env: dict | None = None) -> Result:
    return run_cmd(torchrun_cmd(nproc, *args, max_restarts=max_restarts), timeout=timeout, env=env)


def torchrun2(run_dir: Path, *args: str, max_restarts: int = 1) -> list[str]:
    """2 ranks under torchrun on RUN_DIR, one restart allowed (the drills' kills use it; a run nobody
    kills never restarts): the command of the shared runs (conftest.py's `straight_run`). The preemption
    tests allow none (`max_restarts=0`): a group they stopped stays stopped."""
    return torchrun_cmd(2, f"run.dir={run_dir}", *args, max_restarts=max_restarts)


def wait_until(pred: Callable[[], T], what: str, timeout: float = 120,
               gone: Callable[[], str | None] | None = None, interval: float = 0.05) -> T:
    """The tests' one wait: poll `pred` until it returns something truthy and return that. Fails naming
    `what` after `timeout` seconds, or as soon as `gone()` gives a reason (what was awaited ended first:
    see `exited`)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        reason = gone() if gone else None
        if reason:
            raise AssertionError(f"{what}: {reason}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(interval)


def exited(proc: subprocess.Popen, output: Callable[[], str] = str) -> Callable[[], str | None]:
    """For `wait_until(gone=...)`: the reason once `proc` has exited (its exit code and the tail of
    `output()`), None while it runs."""
    return lambda: None if proc.poll() is None else f"exit {proc.returncode} first\n{output()[-3000:]}"


def at_step(run_dir: Path, kind: str, step: int) -> Callable[[], bool]:
    """For `wait_until`: whether RUN_DIR/metrics.jsonl has a `kind` record at `step` or later."""
    return lambda: any(r["step"] >= step for r in metrics(run_dir, kind, missing_ok=True))


def wait_for_record(run_dir: Path, kind: str, match: Callable[[dict], bool], timeout: float = 240,
                    gone: Callable[[], str | None] | None = None) -> dict:
    """The first `kind` record of RUN_DIR/metrics.jsonl that `match`es, once there is one."""
    return wait_until(lambda: next((r for r in metrics(run_dir, kind, missing_ok=True) if match(r)), None),
                      f"{run_dir}: a matching {kind} record", timeout, gone)


def wait_for_step(run_dir: Path, step: int, timeout: float = 240, kind: str = "train",
                  gone: Callable[[], str | None] | None = None, interval: float = 0.05) -> None:
    """Block until RUN_DIR/metrics.jsonl has a `kind` record (a step trained, by default) at `step` or
    later; fail as soon as `gone()` gives a reason (the run, job or process ended first). A `gone` that
    asks a scheduler (Slurm) is worth a longer `interval`."""
    wait_until(at_step(run_dir, kind, step), f"{run_dir}: a {kind} record at step {step} or later", timeout,
               gone, interval)


def scrape(port: int, timeout: float = 2) -> dict[tuple[str, tuple], float] | None:
    """{(name, sorted labels): value} of the endpoint's samples; None while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def inspect(path: Path) -> dict:
    """`trainapp inspect PATH` (a snapshot's step, world size and parameter hash) through the CLI's entry
    point in this process: its exit code and output as a `python -m trainapp` would give them, without
    the seconds a new Python takes to import torch (the tests call it about a hundred times)."""
    from trainapp import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["inspect", str(path)])
    assert code == 0, f"trainapp inspect {path}: exit {code}\n{out.getvalue()}{err.getvalue()}"
    return json.loads(out.getvalue())


def auto_resumed(output: str, storage_step: int, fault_step: int) -> tuple[str, int]:
    """(tier, step) a run with `snapshot.memory_every_steps=auto` (the default) resumes from after a rank
    died at `fault_step` (a drill: SIGKILL or a hang, before that step's copy), its newest storage
    snapshot at `storage_step`. The tier copies at steps 1 to AUTO_PROBES (its probes), then every N steps,
    N what their measured cost allows (attempt 1's line in `output`: smaller alone, larger beside a second
    lane), and its newest copy of every rank resumes the run when it is at least as new as storage's."""
    chosen = re.search(r"snapshot.memory_every_steps=auto: a copy every (\d+) step", output)
    assert chosen, f"no line of the cadence `auto` chose in the output:\n{output[-3000:]}"
    every = int(chosen[1])
    newest = max([*range(1, AUTO_PROBES + 1), *range(every, fault_step, every)])
    return ("memory", newest) if newest >= storage_step else ("storage", storage_step)


def snapshot_state(step: float) -> dict:
    """A training state as the snapshot code takes it (the model, the optimizer, the progress), every value
    `step`: what a snapshot of step STEP holds in the snapshot store's and manager's tests."""
    import torch

    return {"model": {"w": torch.full((1000,), float(step))},
            "optimizer": {"state": {0: {"m": torch.ones(3) * step}}},
            "progress": {"global_step": int(step)}}


def snapshot_manager(root: Path, keep: int = 3, **kw):
    """A SnapshotManager publishing to ROOT (the newest `keep` kept), a snapshot due every 10 steps; `kw`:
    its other settings (`async_write`, `disk`)."""
    from trainapp.snapshots.manager import SnapshotManager
    from trainapp.snapshots.publish import LocalPublish

    return SnapshotManager(LocalPublish(root, keep), every_steps=10, **kw)


def kill_registered(runtime_root: Path) -> None:
    """SIGKILL the live training processes registered under `runtime_root` (TRAINAPP_RUNTIME_DIR):
    torchrun's workers sit in process groups of their own, and a SIGSTOPped one outlives its agent."""
    from trainapp.faults import drain

    for pid in drain.registered(runtime_root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
