"""The Ray driver's start gate (trainapp/launch/ray/output.py) on real streams of this process: what
Ray prints while a run starts is held, shown in order once rank 0 says it trained a step, or dropped
when the start fails on bad input."""

from __future__ import annotations

import io
import sys
import threading

from trainapp.launch.ray.output import HELD_MAX, StartGate
from trainapp.observe.logs import FIRST_STEP


def gated(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    return StartGate(tick_s=0).install(), out, err


def ray_prints(stream, *lines):
    for line in lines:  # as Ray's printer does: print(..., file=sys.stderr) per line
        print(line, file=stream)


def test_lines_are_held_until_the_first_step_then_shown_in_order_and_passed_through(monkeypatch):
    gate, out, err = gated(monkeypatch)
    ray_prints(sys.stderr, "(TrainController pid=1) Started training worker group of size 2")
    ray_prints(sys.stdout, "(RayTrainWorker pid=2) network: host a: gloo=lo")
    assert out.getvalue() == err.getvalue() == ""
    ray_prints(sys.stderr, f"(RayTrainWorker pid=2) 12:00:00 [rank 0] INFO "
                           f"trainapp.core.loop: {FIRST_STEP}: step 1")
    assert err.getvalue().splitlines() == ["(TrainController pid=1) Started training worker group of size 2",
                                           f"(RayTrainWorker pid=2) 12:00:00 [rank 0] INFO "
                                           f"trainapp.core.loop: {FIRST_STEP}: step 1"]
    assert out.getvalue() == "(RayTrainWorker pid=2) network: host a: gloo=lo\n"
    ray_prints(sys.stderr, "(RayTrainWorker pid=2) step=5 loss=1.2")
    assert err.getvalue().endswith("step=5 loss=1.2\n")
    gate.discard()  # a failure after training started: nothing is taken back
    gate.uninstall()
    assert sys.stderr is err and sys.stdout is out


def test_a_failed_start_drops_what_was_held_and_what_ray_prints_after(monkeypatch):
    gate, out, err = gated(monkeypatch)
    ray_prints(sys.stderr, "(RayTrainWorker pid=2) Traceback (most recent call last):", "  File x",
               "ConfigError: y")
    assert gate.discard() == 3
    ray_prints(sys.stderr, "(pid=gcs_server) E1127 gcs_actor_scheduler.cc:538: Failed")
    gate.uninstall()
    print("trainapp ray: error: y", file=sys.stderr)
    assert err.getvalue() == "trainapp ray: error: y\n" and out.getvalue() == ""


def test_a_run_that_ends_before_a_step_shows_everything_it_held(monkeypatch):
    gate, out, err = gated(monkeypatch)
    ray_prints(sys.stderr, "(RayTrainWorker pid=2) nothing left to train")
    gate.release()
    gate.uninstall()
    assert err.getvalue() == "(RayTrainWorker pid=2) nothing left to train\n"


def test_a_stream_a_logger_kept_passes_through_once_the_gate_is_gone(monkeypatch):
    gate, out, err = gated(monkeypatch)
    kept = sys.stderr  # as Ray's loggers keep the stream they found at import
    gate.discard()
    gate.uninstall()
    print("a late warning", file=kept)
    assert err.getvalue() == "a late warning\n"


def test_a_start_that_says_too_much_is_shown_as_it_goes(monkeypatch):
    gate, out, err = gated(monkeypatch)
    # Ray's printer threads and the driver's own, at once
    threads = [threading.Thread(target=ray_prints,
                                args=(sys.stderr, *[f"line {i}" for i in range(HELD_MAX // 4)]))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert gate.state == "open" and len(err.getvalue().splitlines()) == 4 * (HELD_MAX // 4)
    gate.uninstall()
