"""Ray Train as a launcher: the driver `ray job submit` runs, the worker's set-up and training function,
Ray's private API fenced into one module, the cluster checks, and a local multi-node cluster."""
