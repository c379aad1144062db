"""Faults survived: the heartbeat and hang watchdog, failure records and peers that follow a failed rank
out, preemption notices and the agreed stop, the node-side drain, and the drills that cause each fault."""
