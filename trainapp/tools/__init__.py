"""Tools around a run: `trainapp doctor` (is this node ready for a config?) and `trainapp report` (where
did a run's time go: plots and a summary)."""
