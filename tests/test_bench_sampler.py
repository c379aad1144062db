"""The `launchers` benchmark's CPU sampler reads a thread's CPU finely enough for Ray's small threads."""

import os
import threading
import time

from launchers import CpuSampler


def test_a_thread_using_two_milliseconds_is_read_as_that_not_as_zero_or_a_clock_tick():
    # Ray's I/O, gRPC and task-event threads each use under 1 ms of CPU a second; /proc's clock ticks
    # (10 ms) read such a thread as 0 or 10 ms over a window of seconds.
    sampler = CpuSampler(lambda: [os.getpid()], lambda comm, ppid: True)
    started, measured, done, read = (threading.Event() for _ in range(4))
    tid = []

    def burn():
        tid.append(threading.get_native_id())
        started.set()
        measured.wait()
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.002:
            pass
        done.set()
        read.wait()  # alive until read: a thread that has ended has no /proc entry

    t = threading.Thread(target=burn)
    t.start()
    started.wait()
    before = sampler._threads(os.getpid())[tid[0]][1]
    measured.set()
    done.wait()
    after = sampler._threads(os.getpid())[tid[0]][1]
    read.set()
    t.join()
    assert 0.0015 < after - before < 0.009, after - before
