"""The environment of Ray Train's controller and workers: `controller_env`, set in the driver before
the trainer starts (Ray Train hands these variables from the driver's environment to the controller
and on to every worker).

What Ray has no public way to do:

- Set two controller settings trainapp exposes (`ray.worker_group_start_timeout_s`,
  `ray.health_check_interval_s`) and the preemption watcher's poll interval: Ray Train's controller
  reads them only from environment variables, which no config object carries.
- Keep the job's output to one copy of each line a worker writes: Ray Train's print patch (on by
  default) sends a worker's `print` both to the console and through its logger, so each printed line
  reached the job's output twice; its switch is an environment variable named in a private module
  (`controller_env` turns the patch off unless the driver's environment says otherwise). The other
  half, Ray Train's per-report log line, is report_lines.py's.

Private names: the variables' names, constants of `ray.train.v2._internal.constants`
(`WORKER_GROUP_START_TIMEOUT_S_ENV_VAR`, `HEALTH_CHECK_INTERVAL_S_ENV_VAR`,
`ENABLE_PRINT_PATCH_ENV_VAR`); the poll interval's, which only Ray 2.57 on has, is versions.py's.
"""

from __future__ import annotations

import os

from trainapp.launch.ray.private import unsupported

PRIVATE_NAMES = (
    ("ray.train.v2._internal.constants", "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR"),
    ("ray.train.v2._internal.constants", "HEALTH_CHECK_INTERVAL_S_ENV_VAR"),
    ("ray.train.v2._internal.constants", "ENABLE_PRINT_PATCH_ENV_VAR"),
)
"""(module, name) of every private Ray name used here; tests/test_ray_compat.py imports each one."""

try:  # an import error here is a Ray version trainapp was not written for, said in one line
    from ray.train.v2._internal.constants import (
        ENABLE_PRINT_PATCH_ENV_VAR,
        HEALTH_CHECK_INTERVAL_S_ENV_VAR,
        WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
    )

    from trainapp.launch.ray.private import versions
except ImportError as e:
    raise unsupported(e, __name__) from None


PREEMPTION_POLL_S = 1.0
"""How often Ray Train's preemption watcher asks the GCS for drained nodes (Ray's default: 5 s). A
notice often gives 30 s in all; one small GCS request a second spends less of it."""


def controller_env(worker_group_start_timeout_s: float, health_check_interval_s: float) -> dict[str, str]:
    """The environment that sets Ray Train's controller's worker-group start timeout, poll interval and
    drain-watch interval, and turns off its print patch in the workers (Ray Train hands these
    variables from the driver's environment to the controller and on to every worker). A print patch
    setting already in the driver's environment is kept."""
    env = {WORKER_GROUP_START_TIMEOUT_S_ENV_VAR: str(worker_group_start_timeout_s),
           HEALTH_CHECK_INTERVAL_S_ENV_VAR: str(health_check_interval_s),
           ENABLE_PRINT_PATCH_ENV_VAR: os.environ.get(ENABLE_PRINT_PATCH_ENV_VAR, "0")}
    if versions.PREEMPTION_POLL_INTERVAL_S_ENV_VAR:  # Ray 2.57 on
        env[versions.PREEMPTION_POLL_INTERVAL_S_ENV_VAR] = str(PREEMPTION_POLL_S)
    return env
