"""The `launchers` benchmark's CPU sampler reads a thread's CPU finely enough for Ray's small threads."""

import os
import threading
import time

from bench.launchers import CpuSampler


def test_a_thread_using_two_milliseconds_is_read_as_that_not_as_zero_or_a_clock_tick():
    # Ray's I/O, gRPC and task-event threads each use under 1 ms of CPU a second; /proc's clock ticks
    # (10 ms) read such a thread as 0 or 10 ms over a window of seconds. This thread burns 2 ms.
    sampler = CpuSampler(lambda: [os.getpid()], lambda comm, ppid: True)
    me = threading.get_native_id()
    before = sampler._threads(os.getpid())[me][1]
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.002:
        pass
    after = sampler._threads(os.getpid())[me][1]
    assert 0.0015 < after - before < 0.009, after - before
