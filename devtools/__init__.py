"""Tools for developing trainapp, not shipped with it (pyproject.toml packages `trainapp*` only): the
loopback Ray cluster behind `make ray-up` and the tests and benchmarks that need one."""
