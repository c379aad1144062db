"""The goodput account (trainapp/observe/goodput.py) over records made by hand: each cause where it belongs."""

from __future__ import annotations

import pytest

from trainapp.observe import goodput


def _start(t, step, job, restart=0, resumed=None, launch=None):
    return {"kind": "start", "time": t, "step": step, "global_batch": 100, "restart": restart, "resumed_step": resumed,
            "startup": {"worker_process": launch if launch is not None else t - 2},
            "lease": {"holder": {"job": job}}}


def _train(t, step, sps=1000.0):  # 100 samples a step at 1000/s: 0.1 s a step
    return {"kind": "train", "time": t, "step": step, "samples_per_s": sps}


def test_a_hang_then_a_resubmission_later_are_detection_redone_and_time_between_attempts():
    records = [
        _start(100.0, 0, "alone:a"),                       # launched at 98: 2 s of start-up
        _train(101.0, 10), _train(102.0, 20),               # 20 steps, 0.1 s each, from 100.0 to 102.0
        {"kind": "snapshot", "time": 102.0, "step": 20, "blocking_s": 0.5},
        _train(103.5, 30),                                  # 10 more (1.0 s) after the 0.5 s snapshot
        {"kind": "failure", "time": 123.5, "step": 30, "cause": "hang"},  # the watchdog: 20 s after the last step
        _start(200.0, 20, "alone:b", resumed=20, launch=195.0),  # a new job 71.5 s later
        _train(201.0, 30), _train(202.0, 40),
        {"kind": "end", "time": 202.0, "steps": 40},
    ]
    acc = goodput.account(records)
    bad = acc["badput_s"]
    assert acc["wall_s"] == pytest.approx(202.0 - 98.0)
    assert bad["startup"] == pytest.approx(2.0 + 5.0)
    assert bad["detection"] == pytest.approx(20.0)
    assert acc["steps_redone"] == 10 and bad["redone"] == pytest.approx(1.0)
    assert bad["snapshot"] == pytest.approx(0.5)
    assert bad["between_attempts"] == pytest.approx(195.0 - 123.5) and bad["restart"] == 0
    assert acc["goodput_s"] == pytest.approx(2.0 + 2.0)  # steps 1-20 of the first attempt, 21-40 of the second
    assert abs(bad["other"]) < 1e-6
    assert goodput.table(acc)[0].startswith("goodput        3.8% of 104.0 s")


def test_the_same_jobs_restart_is_a_restart_and_a_notice_is_no_failure():
    records = [
        _start(10.0, 0, "torchrun:x"), _train(11.0, 10),
        {"kind": "preempted", "time": 11.4, "step": 12, "signal": "SIGTERM"},  # 2 steps after the record, then 0.2 s
        _start(20.0, 12, "torchrun:x", resumed=12, launch=15.0),
        _train(21.0, 22), {"kind": "end", "time": 21.0},
    ]
    acc = goodput.account(records)
    bad = acc["badput_s"]
    assert acc["steps_redone"] == 0 and bad["restart"] == pytest.approx(15.0 - 11.4)
    assert bad["notice"] == pytest.approx(0.2) and bad["detection"] == 0
    assert [a["ended_by"] for a in acc["attempts"]] == ["notice", "end"]
    assert acc["goodput_s"] == pytest.approx(1.2 + 1.0)
