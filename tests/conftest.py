from pathlib import Path

import pytest

# Tests `make test` leaves to a CI step of their own: marker -> (option, the target that runs them).
SEPARATE = {
    "slurm": ("--slurm", "starts a real Slurm: make slurm-smoke runs it (CI does, after make test)"),
    "bench": ("--bench", "a benchmark's smoke run: make bench-smoke runs it (CI does, after make test)"),
}


def pytest_addoption(parser):
    parser.addoption("--slurm", action="store_true",
                     help="also run the tests that start a real Slurm (make slurm-smoke; CI runs it after make test)")
    parser.addoption("--bench", action="store_true",
                     help="also run the benchmarks' smoke runs (make bench-smoke; CI runs it after make test)")


def pytest_collection_modifyitems(config, items):
    for marker, (option, why) in SEPARATE.items():
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=why)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
