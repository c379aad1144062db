"""Ray Train's record of a resubmitted run, read in the driver before the trainer starts:
`check_run_record`.

What Ray has no public way to do: say in one line when Ray Train will refuse to resume a run. Its
record of the run's checkpoints lives in a file whose name is a private constant, and the error Ray
raises when a checkpoint it names is gone is a private exception, raised in the controller with a
traceback and the advice to delete the run's directory, snapshots and all.

Private names: `CHECKPOINT_MANAGER_SNAPSHOT_FILENAME` (`ray.train.v2._internal.constants`).
"""

from __future__ import annotations

import json

from trainapp.config import ConfigError
from trainapp.launch.ray.checks import run_store
from trainapp.launch.ray.private import unsupported

PRIVATE_NAMES = (
    ("ray.train.v2._internal.constants", "CHECKPOINT_MANAGER_SNAPSHOT_FILENAME"),
)
"""(module, name) of every private Ray name used here; tests/test_ray_compat.py imports each one."""

try:  # an import error here is a Ray version trainapp was not written for, said in one line
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
except ImportError as e:
    raise unsupported(e, __name__) from None


def check_run_record(storage: str, name: str) -> None:
    """In the driver, before `fit`: ConfigError when Ray's record of the run STORAGE/NAME (a resubmission)
    names a checkpoint that is gone, which Ray Train refuses to resume (someone deleted a `step_*`
    directory, or a bucket's lifecycle rule did). A record that is missing or unreadable is left to
    Ray, whose own error says what is wrong with it (another Ray version's, say)."""
    from pyarrow.fs import FileType

    fs, run, shown = run_store(storage, name)
    try:
        with fs.open_input_stream(f"{run}/{CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}") as f:
            names = [r["checkpoint_dir_name"] for r in json.loads(f.read())["checkpoint_results"]]
    except (OSError, ValueError, KeyError, TypeError):
        return
    infos = fs.get_file_info([f"{run}/{n}" for n in names])
    gone = [n for n, info in zip(names, infos) if info.type != FileType.Directory]
    if gone:
        raise ConfigError(f"ray.name={name}: Ray's record of this run "
                          f"({shown}/{CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}) names {', '.join(gone)}, gone "
                          f"from {shown}, and Ray Train will not resume it; restore the snapshot, or move "
                          f"the record aside to resume from the newest snapshot left there (Ray forgets "
                          f"the metrics it recorded), or use a new ray.name to start afresh")
