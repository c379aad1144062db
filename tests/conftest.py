from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption("--slurm", action="store_true",
                     help="also run the tests that start a real Slurm (make slurm-smoke; CI runs it after make test)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slurm"):
        return
    skip = pytest.mark.skip(reason="starts a real Slurm: make slurm-smoke runs it (CI does, after make test)")
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
