"""Snapshots: atomic, checksummed directories of everything a run needs to continue exactly, written by
rank 0, kept last-k, found again newest-valid-first, and published where the launcher wants them."""
