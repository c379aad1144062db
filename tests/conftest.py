from pathlib import Path

import pytest
from helpers import FAULT_RUN, FSDP_RUN, torchrun

from bench.scratch import scratch

# Tests `make test` leaves to a CI step of their own: marker -> (option, the target that runs them).
SEPARATE = {
    "e2e": ("--e2e", "a long end-to-end fault scenario: make test-e2e runs it "
                     "(CI does, last, where the CPU leaves room)"),
    "slurm": ("--slurm", "starts a real Slurm: make slurm-smoke runs it (CI does, after make test)"),
    "bench": ("--bench", "a benchmark's smoke run: make bench-smoke runs it (CI does not)"),
}


def pytest_addoption(parser):
    for marker, (option, why) in SEPARATE.items():
        parser.addoption(option, action="store_true", help=f"also run the tests marked {marker} ({why})")


def pytest_collection_modifyitems(config, items):
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


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(scope="session")
def torchrun_restarted(tmp_path_factory) -> Path:
    """One run several test files read: 2 ranks under torchrun, rank 1 SIGKILLed at step 13 by the drill
    and the group restarted from the step-10 snapshot, a record and TensorBoard scalars at every step.
    tests/test_loop.py checks its resume is bitwise, tests/test_report.py its report and TensorBoard files."""
    run_dir = tmp_path_factory.mktemp("restarted") / "run"
    r = torchrun(2, f"run.dir={run_dir}", *FAULT_RUN, "drill.kill_at_step=13", "drill.rank=1", "train.log_every=1",
                 "observe.tensorboard=true", max_restarts=1)
    assert r.returncode == 0, r.output[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def fsdp_straight(tmp_path_factory) -> Path:
    """One FSDP run several test files read (2 ranks, sharded snapshots every 5 steps, EMA): tests/test_fsdp.py
    resumes against it, tests/test_export.py exports from its shards."""
    run_dir = tmp_path_factory.mktemp("fsdp-straight") / "run"
    r = torchrun(2, f"run.dir={run_dir}", *FSDP_RUN)
    assert r.returncode == 0, r.output[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def torchrun_straight(tmp_path_factory) -> Path:
    """`torchrun_restarted`'s twin that nobody killed: tests/test_loop.py compares their parameters,
    tests/test_export.py their exported models."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    r = torchrun(2, f"run.dir={run_dir}", *FAULT_RUN)
    assert r.returncode == 0, r.output[-3000:]
    return run_dir
