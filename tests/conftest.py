from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import FAULT_RUN, FSDP_RUN, run_cmd, torchrun2

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
def straight_run(tmp_path_factory) -> Callable[..., Path]:
    """`straight_run(cmd, *args, env=None)`: the run directory of `cmd(run_dir, *args)` trained to its
    end, never interrupted: the twin an interrupted run must end bitwise equal to. Each distinct command
    runs once per session, so every test (in any file) that needs the same twin shares one run."""
    runs: dict[tuple, Path] = {}

    def get(cmd: Callable[..., list[str]], *args: str, env: dict | None = None) -> Path:
        key = (*cmd(Path("RUN_DIR"), *args), *sorted((env or {}).items()))
        if key not in runs:
            run_dir = tmp_path_factory.mktemp("straight") / "run"
            r = run_cmd(cmd(run_dir, *args), timeout=600, env=env)
            assert r.returncode == 0, r.output[-3000:]
            runs[key] = run_dir
        return runs[key]

    return get


@pytest.fixture(scope="session")
def torchrun_restarted(tmp_path_factory) -> Path:
    """One run several test files read: 2 ranks under torchrun, rank 1 SIGKILLed at step 13 by the drill
    and the group restarted from the step-10 snapshot, a record and TensorBoard scalars at every step.
    tests/test_loop.py checks its resume is bitwise, tests/test_report.py its report and TensorBoard files."""
    run_dir = tmp_path_factory.mktemp("restarted") / "run"
    r = run_cmd(torchrun2(run_dir, *FAULT_RUN, "drill.kill_at_step=13", "drill.rank=1", "train.log_every=1",
                          "observe.tensorboard=true"))
    assert r.returncode == 0, r.output[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def fsdp_straight(straight_run) -> Path:
    """One FSDP run several test files read (2 ranks, sharded snapshots every 5 steps, EMA): tests/test_fsdp.py
    resumes against it, tests/test_export.py exports from its shards."""
    return straight_run(torchrun2, *FSDP_RUN)


@pytest.fixture(scope="session")
def torchrun_straight(straight_run) -> Path:
    """`torchrun_restarted`'s twin that nobody killed: tests/test_loop.py compares their parameters,
    tests/test_export.py their exported models, tests/test_hang.py a hung rank's restarted run."""
    return straight_run(torchrun2, *FAULT_RUN)
