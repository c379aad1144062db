import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from scratch import scratch  # noqa: E402

# Tests `make test` leaves to a CI step of their own: marker -> (option, the target that runs them).
SEPARATE = {
    "slurm": ("--slurm", "starts a real Slurm: make slurm-smoke runs it (CI does, after make test)"),
    "bench": ("--bench", "a benchmark's smoke run: make bench-smoke runs it (CI does, after make test)"),
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
