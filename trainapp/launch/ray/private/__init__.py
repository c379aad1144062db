"""The fence around Ray's private API: every use trainapp makes of it, one module per job, for the Ray
versions in trainapp.launch.ray.checks.SUPPORTED.

Ray Train's public API carries the training itself (TorchTrainer, ScalingConfig, RunConfig,
FailureConfig, CheckpointConfig, `ray.train.report` / `get_checkpoint`, WorkerGroupError and
ControllerError). What it has no public way to do is done here: each module says what, and with which
private names, and lists them in its `PRIVATE_NAMES` ((module, name) pairs). No other module of
trainapp names a private Ray name. tests/test_ray_compat.py walks this folder: it imports every name
listed on the installed Ray (an upgrade that moves one fails there, by name), checks that each module
lists every private name its code uses, and that no module outside the folder reaches into Ray's
private modules. What differs between the supported Rays is versions.py's.

`check_version()` (trainapp/launch/ray/checks.py, which imports no Ray, so it runs first) stops the Ray
driver with one line on a Ray outside SUPPORTED; a module here that cannot import a Ray name it needs
stops it with one line too (`unsupported`), not a traceback.

Importing this package imports no Ray and no torch: each module imports Ray Train (seconds) for its own
job, and those Ray Train's controller unpickles must not import torch.
"""

from __future__ import annotations

import sys

from trainapp.config import ConfigError
from trainapp.launch.ray.checks import SUPPORTED


def unsupported(e: ImportError, module: str) -> ConfigError:
    """The one line for `e`, a Ray name the module `module` (its `__name__`) needs that does not import:
    a Ray version trainapp was not written for."""
    return ConfigError(f"ray: cannot import a name trainapp needs ({e}); trainapp's Ray launcher was written "
                       f"for Ray >={SUPPORTED[0]},<{SUPPORTED[1]} ({module.replace('.', '/')}.py)")


def say(msg: str) -> None:
    """One line from trainapp's code in Ray Train's controller (its callbacks, the backend)."""
    # The controller's stdout reaches the job's log (`ray job logs`) prefixed with its actor name.
    print(f"trainapp: {msg}", file=sys.stderr, flush=True)
