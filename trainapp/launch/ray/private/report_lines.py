"""Ray Train's per-report log line kept off the job's output: `quiet_report_lines`, in every worker.

What Ray has no public way to do: Ray Train logs "Reporting training result N: ..." at INFO on every
rank for every report, from its private execution-context module; the public
`LoggingConfig(log_level=...)` would also hide Ray Train's other INFO lines ("Started training worker
group"). The other half of one copy of each line in the job's output, the print patch, is
controller.py's.

Private names: the `logger` of `ray.train.v2._internal.execution.context`.
"""

from __future__ import annotations

import logging

from trainapp.launch.ray.private import unsupported

PRIVATE_NAMES = (
    ("ray.train.v2._internal.execution.context", "logger"),
)
"""(module, name) of every private Ray name used here; tests/test_ray_compat.py imports each one."""

try:  # an import error here is a Ray version trainapp was not written for, said in one line
    from ray.train.v2._internal.execution.context import logger as _report_logger
except ImportError as e:
    raise unsupported(e, __name__) from None


def _no_report_info(record: logging.LogRecord) -> bool:
    return record.name != _report_logger.name or record.levelno >= logging.WARNING


def quiet_report_lines() -> None:
    """In a worker, after Ray Train configured its logging: its per-report INFO line ("Reporting
    training result N: TrainingReport(...) from rank R", one per rank per snapshot) no longer goes to
    the console, so not to the job's output. Ray Train's log files under the session's `logs/train`
    keep it. trainapp's `snapshot` records in metrics.jsonl say the same."""
    for handler in logging.getLogger("ray.train").handlers:
        # The console handler is a StreamHandler; the session's log files are handlers of their own.
        console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
        if console and _no_report_info not in handler.filters:
            handler.addFilter(_no_report_info)
