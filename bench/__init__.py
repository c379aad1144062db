"""The benchmarks: each module is one, run from the repository root as `python -m bench.NAME`
(`make bench` runs them all; `--smoke` is each one's short mode, `make bench-smoke` checks those).
`bench.common` holds what several of them share: paths, the benchmark run's overrides, launch
commands and the readers of a run's records."""
