import os
import shutil
import tempfile
from pathlib import Path

import pytest

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
    """One temp directory for every process the tests start, removed at the end. The tests SIGKILL
    processes that never get to remove their own: torchrun leaves a torchelastic_* directory per
    run, multiprocessing a pymp-* one per killed listener, and /tmp would keep hundreds per run."""
    path = tempfile.mkdtemp(prefix="ta-tests-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = path
    yield Path(path)
    if before is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
