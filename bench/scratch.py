"""A scratch directory that the processes a benchmark (or the test suite) starts also use as their
temp directory, removed at the end. torchrun leaves a torchelastic_* directory in TMPDIR per run and
a killed process its multiprocessing pymp-* directory: without this, every benchmark run and every
`make test` left dozens in /tmp."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as path:
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = path  # for child processes: this one's tempfile has cached its directory
        try:
            yield path
        finally:
            if before is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = before
