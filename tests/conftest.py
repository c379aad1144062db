import contextlib
import hashlib
import json
import os
import pickle
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock
from hypothesis import settings
from helpers import (FAULT_RUN, FSDP_RUN, RANKS_RUN, REPO, free_port, inspect, run_cmd, scrape, torchrun2,
                     torchrun_cmd, value, wait_until)

from census import Census
from lanes import Lanes

from bench.scratch import scratch

# Tests `make test` leaves to a CI step of their own: marker -> (option, the target that runs them).
SEPARATE = {
    "e2e": ("--e2e", "a long end-to-end fault scenario: make test-e2e runs it "
                     "(CI does, after make test-long)"),
    "slurm": ("--slurm", "starts a real Slurm: make slurm-smoke runs it (CI does, after make test)"),
    "bench": ("--bench", "a benchmark's smoke run: make bench-smoke runs it (CI does not)"),
}


def pytest_addoption(parser):
    for marker, (option, why) in SEPARATE.items():
        parser.addoption(option, action="store_true", help=f"also run the tests marked {marker} ({why})")
    parser.addoption("--census", type=Path, metavar="FILE",
                     help="count the processes each test file starts into FILE (a lane's: FILE-gwN), "
                          "tests/census.py")


def pytest_configure(config):
    census = config.getoption("--census")
    # Under pytest-xdist the lanes run the tests; the process that hands them out counts nothing.
    if census and (os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None)):
        config.pluginmanager.register(Census(census.absolute()), "census")
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(Lanes(), "lanes")


LONG = ("test_ray.py", "test_ray_resume.py", "test_compile.py", "test_lease.py", "test_preempt.py",
        "test_fsdp.py", "test_hang.py", "test_tracking.py", "test_storage.py", "test_failure.py",
        "test_async_snapshot.py", "test_malloc.py")
"""The files of `make test-long` (marker `long`): the process-heavy ones, mostly fault scenarios, that each
train, kill, restart or compile runs for minutes on a 2-core machine (a Ray cluster, torchrun's restarts,
preemption, the lease, FSDP, hangs, full disks, failures explained, background snapshot writes, compile,
a tracking server, the allocator check), which `make test` leaves out to stay under 10 minutes; CI runs
both."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in LONG:
            item.add_marker(pytest.mark.long)
    for marker, (option, why) in SEPARATE.items():
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=why)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def children_temp_dir():
    """One temp directory for every process the tests start, removed at the end: the tests SIGKILL
    processes that never get to remove their own (bench/scratch.py)."""
    with scratch("ta-tests-") as path:
        yield Path(path)


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or the only process), once
        from trainapp.snapshots.memory import default_dir

        session.config.stash[MEMORY_BEFORE] = set(default_dir().glob("run-*"))


def pytest_sessionfinish(session):
    """The memory tier's copies the session's runs left in the default memory directory (a run killed for
    good keeps its copies: its restart would read them), removed once every worker is done; those that
    were there before are left alone."""
    if hasattr(session.config, "workerinput") or MEMORY_BEFORE not in session.config.stash:
        return
    from trainapp.snapshots.memory import default_dir

    for run in set(default_dir().glob("run-*")) - session.config.stash[MEMORY_BEFORE]:
        shutil.rmtree(run, ignore_errors=True)


MEMORY_BEFORE = pytest.StashKey[set]()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(scope="session")
def shared(tmp_path_factory) -> Callable[[str, Callable[[Path], None]], Path]:
    """`shared(name, make)`: the directory NAME, made by `make(directory)` once per test session, in
    whichever pytest-xdist worker asks first (`make test` runs two); the others wait for it and reuse
    it. Every shared run below is one of these. A `make` that failed fails every later asker the same
    way instead of running again."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the parent: every worker's

    def get(name: str, make: Callable[[Path], None]) -> Path:
        where = root / "shared" / name
        where.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{where}.lock"):
            failed = where.with_name(f"{name}.failed")
            if failed.exists():
                raise AssertionError(f"the shared {name} failed in another worker:\n{failed.read_text()}")
            if not where.with_name(f"{name}.done").exists():
                try:
                    make(where)
                except BaseException as e:
                    failed.write_text(str(e)[-4000:])
                    raise
                where.with_name(f"{name}.done").touch()
        return where

    return get


@pytest.fixture(scope="session")
def straight_run(shared) -> Callable[..., Path]:
    """`straight_run(cmd, *args, env=None)`: the run directory of `cmd(run_dir, *args)` trained to its
    end, never interrupted: the twin an interrupted run must end bitwise equal to. Each distinct command
    runs once per session, so every test (in any file, on any worker) that needs the same twin shares
    one run."""

    def get(cmd: Callable[..., list[str]], *args: str, env: dict | None = None) -> Path:
        key = json.dumps([*cmd(Path("RUN_DIR"), *args), sorted((env or {}).items())])
        name = f"straight-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        return shared(name, lambda where: _trained(cmd(where / "run", *args), env)) / "run"

    return get


def _trained(cmd: list[str], env: dict | None = None) -> None:
    r = run_cmd(cmd, timeout=600, env=env)
    assert r.returncode == 0, r.output[-3000:]


@pytest.fixture(scope="session")
def straight_sha(straight_run) -> Callable[..., str]:
    """`straight_sha(cmd, *args)`: the params_sha256 of `straight_run(cmd, *args)`, the run never stopped
    that a stopped and resumed one must end bitwise equal to (the preemption, FSDP and Slurm tests)."""
    return lambda cmd, *args: inspect(straight_run(cmd, *args))["params_sha256"]


@pytest.fixture(scope="session")
def torchrun_restarted(shared) -> Path:
    """One run several test files read: 2 ranks under torchrun, rank 1 SIGKILLed at step 13 by the drill
    and the group restarted from the step-10 snapshot, a record and TensorBoard scalars at every step.
    tests/test_loop.py checks its resume is bitwise, tests/test_report.py its report and TensorBoard files.
    No rank is slowed, and the report must name no straggler: at 1.5x, as the default 1.2x over 3 one-step
    intervals was crossed once by scheduling alone (4 processes on 2 cores beside make test's other lane;
    the slowed run below is where a straggler is found)."""
    return shared("restarted", lambda where: _trained(torchrun2(
        where / "run", *FAULT_RUN, "drill.kill_at_step=13", "drill.rank=1", "train.log_every=1",
        "observe.tensorboard=true", "observe.straggler_ratio=1.5"))) / "run"


@pytest.fixture(scope="session")
def fsdp_straight(straight_run) -> Path:
    """One FSDP run several test files read (2 ranks, sharded snapshots every 5 steps, EMA):
    tests/test_fsdp.py resumes against it, tests/test_export.py exports from its shards."""
    return straight_run(torchrun2, *FSDP_RUN)


@pytest.fixture(scope="session")
def torchrun_straight(straight_run) -> Path:
    """`torchrun_restarted`'s twin that nobody killed: tests/test_loop.py compares their parameters,
    tests/test_export.py their exported models, tests/test_hang.py a hung rank's restarted run."""
    return straight_run(torchrun2, *FAULT_RUN)


@dataclass
class SlowedRun:
    run_dir: Path
    output: str
    port: int
    scrapes: list[dict]
    """Every answer of the live metrics endpoint while it trained, from the first with a step to the first
    with the goodput ratio, a snapshot step and rank 1 flagged a straggler."""


@pytest.fixture(scope="session")
def slowed_run(shared) -> SlowedRun:
    """One run two test files read: RANKS_RUN under torchrun with rank 1 slowed 200 ms a step in its compute
    (a straggler after 3 log intervals), its live metrics endpoint scraped over HTTP while it trains.
    tests/test_observe.py checks the straggler records, tests/test_live_metrics.py the scrapes."""
    return pickle.loads((shared("slowed", _slowed) / "slowed.pickle").read_bytes())


def _slowed(where: Path) -> None:

    run_dir, port = where / "run", free_port()
    # 200 ms: the ratio to the median of two ranks is (b + 200) / (b + 100) for a step of b ms, over 1.2 up to
    # b = 400 ms; 80 ms (up to b = 160) was too close on a slower CPU (an EPYC: b 100-300 ms).
    cmd = torchrun_cmd(2, f"run.dir={run_dir}", *RANKS_RUN, "drill.slow_rank=1", "drill.slow_ms=200",
                       "observe.straggler_intervals=3", f"observe.prometheus_port={port}")
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    scrapes: list[dict] = []
    wanted = (("trainapp_goodput_ratio", {}), ("trainapp_snapshot_step", {}),
              ("trainapp_straggler", {"rank": "1"}))

    def scraped_all() -> bool:
        got = scrape(port)
        if got and value(got, "trainapp_step", run=run_dir.name):
            scrapes.append(got)
        return len(scrapes) >= 2 and all(value(scrapes[-1], n, run=run_dir.name, **labels)
                                         for n, labels in wanted)

    try:
        with contextlib.suppress(AssertionError):  # the test says what was missing
            wait_until(scraped_all, "every live metric", 120,
                       gone=lambda: proc.poll() is not None and "ended", interval=0.5)
    finally:
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    (where / "slowed.pickle").write_bytes(pickle.dumps(SlowedRun(run_dir, out, port, scrapes)))


class LocalRay:
    """The local Ray cluster of tests/test_ray.py and tests/test_ray_resume.py (devtools/local_ray.py: a
    head and 2 worker nodes of 1 CPU on loopback, its own short directory under /tmp and HOME), at most
    one at a time per test process. Started by the first test that asks for `cluster`, it stays up while
    tests still to run ask for it, whichever file they are in, and goes down at the end of the file after
    which none does (`pytest_runtest_teardown` below), or at the end of the session: one start per run of
    those files in every tier (a start takes minutes on a 2-core machine). A start that failed fails
    every later asker the same way instead of starting again."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        self._tmp = tmp_path_factory
        self.cluster = None
        self._failed: BaseException | None = None

    def get(self):
        if self._failed is not None:
            raise self._failed
        if self.cluster is None:
            from ray_jobs import start_cluster

            try:
                c = start_cluster()
            except BaseException as e:
                self._failed = e
                raise
            c.storage = self._tmp.mktemp("ray") / "storage"
            self.cluster = c
        return self.cluster

    def stop(self) -> None:
        c, self.cluster = self.cluster, None
        if c is not None:
            from ray_jobs import stop_cluster

            stop_cluster(c)


LOCAL_RAY = pytest.StashKey[LocalRay]()


@pytest.fixture(scope="session")
def local_ray(pytestconfig, tmp_path_factory) -> Iterator[LocalRay]:
    ray = pytestconfig.stash[LOCAL_RAY] = LocalRay(tmp_path_factory)
    try:
        yield ray
    finally:
        ray.stop()


@pytest.fixture(scope="module")
def cluster(local_ray):
    """The local Ray cluster (`LocalRay`), with `storage`: a directory for the jobs' `ray.storage_path`."""
    return local_ray.get()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The local Ray cluster goes down at the end of a test file once no test still to run in this process
    asks for it: of the tests after this one (a pytest-xdist worker knows only the next one, and takes a
    whole file at a time), those that ask for `cluster` and are not skipped."""
    result = yield
    ray = item.config.stash.get(LOCAL_RAY, None)
    if ray is not None and ray.cluster is not None and "local_ray" in item.fixturenames:
        # A job a failed test left running would hold the worker nodes the next tests' jobs wait for.
        if left := ray.cluster.stop_running_jobs():
            print(f"\nstopped the jobs {item.name} left running: {left}")
        # A node it killed and did not replace (it failed first) would be missing from every test after it.
        if healed := ray.cluster.heal(cwd=REPO):
            print(f"\nreplaced the worker nodes {item.name} left dead: {healed}")
    if ray is None or ray.cluster is None or (nextitem is not None and nextitem.path == item.path):
        return result
    if hasattr(item.config, "workerinput"):
        later = [nextitem] if nextitem is not None else []
    else:
        later = item.session.items[item.session.items.index(item) + 1:]
    if not any("local_ray" in i.fixturenames and i.get_closest_marker("skip") is None for i in later):
        ray.stop()
    return result


# Property tests (hypothesis) draw new examples in every run on a developer's machine; CI's runs
# (.ci/run sets HYPOTHESIS_PROFILE=ci) draw the same ones, so a red CI run is a change's, not a draw's.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 KiB tmpfs (root mounts it), unmounted after; skipped where it cannot be mounted."""
    where = tmp_path / "tiny"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=False)
