"""What a run leaves to look at: metrics.jsonl, log lines, per-rank phase timings and stragglers, the
start-up timeline and TensorBoard files. Standard library only at import (scripts read metrics.jsonl
with a bare python3)."""
