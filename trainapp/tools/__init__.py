"""Tools around a run: `trainapp doctor` (and `--comm`), `trainapp report`."""
