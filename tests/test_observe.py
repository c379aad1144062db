"""Per-rank timings (trainapp/observe/timings.py): the rows every rank gathers, the `ranks` record and the
straggler watch, on their own and in two real processes with one slowed by `drill.slow_rank`
(test_loop.py's `make run` test checks a run without the drill; test_report.py the TensorBoard files
of a run with a restart)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from helpers import RANKS_RUN, inspect, metrics, torchrun

from trainapp.observe import timings


def _row(steps, cpu=0.0, **seconds):
    return [float(steps), *(seconds.get(p, 0.0) for p in timings.TIMED), cpu]


def test_rank_rows_are_per_step_milliseconds_whose_phases_add_up_to_the_step():
    rows = [_row(10, data=0.05, compute=0.2, comm=0.1, optim=0.05, eval=1.0, cpu=0.45),
            _row(10, data=0.05, compute=0.3, comm=0.0, optim=0.05)]
    ranks = timings.rank_rows(rows, ["a", "b"])
    assert [r["host"] for r in ranks] == ["a", "b"]
    assert ranks[0]["step_ms"] == pytest.approx(40.0) and ranks[0]["busy_ms"] == pytest.approx(30.0)
    assert ranks[0]["phase_ms"]["eval"] == pytest.approx(100.0)  # kept, but not part of the step
    assert sum(ranks[0]["share"].values()) == pytest.approx(1.0, abs=1e-3)
    assert ranks[1]["share"]["compute"] == pytest.approx(0.75)
    assert ranks[0]["cpu_ms"] == pytest.approx(45.0) and ranks[1]["cpu_ms"] == 0.0


def test_a_straggler_is_named_after_the_configured_intervals_once_with_its_slow_phase():
    watch = timings.Stragglers(ratio=1.2, intervals=3)
    slow = [_row(10, compute=0.2, optim=0.05, comm=0.15), _row(10, compute=0.5, optim=0.05)]
    for step in (10, 20):
        assert watch.update(step, timings.rank_rows(slow, ["a", "b"])) == []
    [found] = watch.update(30, timings.rank_rows(slow, ["a", "b"]))
    assert (found["rank"], found["host"], found["phase"], found["intervals"]) == (1, "b", "compute", 3)
    assert found["phase_ms"] == pytest.approx(50.0) and found["median_phase_ms"] == pytest.approx(35.0)
    assert found["ratio"] == pytest.approx(55 / 40)
    assert watch.update(40, timings.rank_rows(slow, ["a", "b"])) == []  # once, not at every interval
    line = timings.straggler_line(found, 1.2)
    assert "rank 1 on b" in line and "compute" in line and "observe.straggler_ratio=1.2" in line


def test_an_interval_back_under_the_line_resets_the_count():
    watch = timings.Stragglers(ratio=1.2, intervals=2)
    slow = timings.rank_rows([_row(5, compute=0.1), _row(5, data=0.3)], ["a", "b"])
    even = timings.rank_rows([_row(5, compute=0.1), _row(5, compute=0.1)], ["a", "b"])
    for ranks in (slow, even, slow, even):
        assert watch.update(0, ranks) == []
    assert watch.update(0, slow) == []
    assert watch.update(0, slow)[0]["phase"] == "data"


def test_a_rank_with_one_more_micro_batch_by_design_is_no_straggler_but_a_slow_one_still_is():
    """A global batch of 3 micro-batches over 2 ranks: rank 0 runs two, rank 1 one
    (trainapp/core/layout.py)."""
    uneven = timings.rank_rows([_row(5, compute=0.2, optim=0.02), _row(5, compute=0.1, optim=0.02, comm=0.1)],
                               ["a", "b"])
    assert timings.Stragglers(ratio=1.2, intervals=1).update(0, uneven)  # without the layout: a false alarm
    watch = timings.Stragglers(ratio=1.2, intervals=1)
    watch.work = [2, 1]
    assert watch.update(0, uneven) == []
    slow = timings.rank_rows([_row(5, compute=0.2, optim=0.02), _row(5, compute=0.3, optim=0.02)], ["a", "b"])
    assert [f["rank"] for f in watch.update(5, slow)] == [1]


def test_ranks_within_the_ratio_and_a_single_rank_are_never_stragglers():
    watch = timings.Stragglers(ratio=1.2, intervals=1)
    close = timings.rank_rows([_row(5, compute=0.10), _row(5, compute=0.11), _row(5, compute=0.12)],
                              ["a"] * 3)
    assert watch.update(0, close) == []
    assert watch.update(0, timings.rank_rows([_row(5, compute=1.0)], ["a"])) == []


def test_the_clock_splits_wall_time_into_phases_tells_the_heartbeat_and_the_last_bucket_marks_the_comm_wait():
    told = []
    clock = timings.PhaseClock(torch.device("cpu"), on_phase=told.append)
    clock.enter("data")
    time.sleep(0.02)
    clock.enter("compute")
    time.sleep(0.03)
    clock._handoff = clock._now()  # what the DDP hook does at the last bucket
    time.sleep(0.01)
    clock.enter("optim")
    time.sleep(0.01)
    clock.enter("other")
    clock.step_done()
    row = clock.collect()
    got = dict(zip(timings.TIMED, row[1:]))
    assert row[0] == 1 and told == ["data", "compute", "optim", "other"]
    assert got["data"] == pytest.approx(0.02, abs=0.015) and got["compute"] == pytest.approx(0.03, abs=0.015)
    assert got["comm"] == pytest.approx(0.01, abs=0.01) and got["optim"] == pytest.approx(0.01, abs=0.01)
    assert clock.collect()[0] == 0 and sum(clock.collect()[1:]) < 0.01  # the next interval starts empty


def test_a_phase_block_returns_to_the_phase_before_it():
    told = []
    clock = timings.PhaseClock(torch.device("cpu"), on_phase=told.append)
    with clock.phase("eval"):
        time.sleep(0.02)
    got = dict(zip(timings.TIMED, clock.collect()[1:]))
    assert told == ["eval", "other"] and clock.current == "other"
    assert got["eval"] == pytest.approx(0.02, abs=0.015)


def test_the_timer_counts_the_process_cpu_time_of_every_thread_not_the_wall_time():
    clock = timings.PhaseClock(torch.device("cpu"))
    time.sleep(0.1)
    assert clock.collect()[-1] < 0.05  # asleep: wall time, no CPU

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    other = threading.Thread(target=spin, args=(0.1,))  # CPU burnt outside the training thread counts
    other.start()
    spin(0.1)
    other.join()
    assert clock.collect()[-1] >= 0.19


def test_restart_drops_the_set_up_time_before_the_first_step():
    clock = timings.PhaseClock(torch.device("cpu"))
    time.sleep(0.05)  # building, resuming, the start record
    clock.restart()
    clock.enter("data")
    assert sum(clock.collect()[1:]) < 0.01


def test_a_disabled_clock_records_nothing_but_still_tells_the_heartbeat():
    told = []
    clock = timings.PhaseClock(torch.device("cpu"), enabled=False, on_phase=told.append)
    clock.enter("data")
    clock.enter("compute")
    clock.enter("optim")
    assert sum(clock.collect()[1:]) == 0 and told == ["data", "compute", "optim"]


# ----------------------------------------------------------------------------------------------
# Two real processes under torchrun



def _named_once_per_streak(found, phase, intervals=3, log_every=5):
    """Rank 1 alone, in `phase`, after `intervals` log intervals in a row; named once per streak, not at
    every interval: a second report (a busy machine can end the first streak for one interval) comes only
    after a break and a whole new streak, so at least (intervals + 1) * log_every steps later."""
    assert found, "rank 1 was never named a straggler"
    assert ([(s["rank"], s["phase"], s["intervals"]) for s in found]
            == [(1, phase, intervals)] * len(found)), found
    gaps = [b["step"] - a["step"] for a, b in zip(found, found[1:])]
    assert all(g >= (intervals + 1) * log_every for g in gaps), found


@pytest.mark.slow
def test_a_slowed_rank_is_named_a_straggler_within_the_configured_intervals(slowed_run, tmp_path):
    run_dir, out = slowed_run.run_dir, slowed_run.output  # rank 1 slowed 200 ms a step (conftest.py)
    found = metrics(run_dir, "straggler")
    _named_once_per_streak(found, "compute")
    s = found[0]
    assert (s["rank"], s["phase"]) == (1, "compute") and s["intervals"] == 3
    assert s["step"] <= 20, s  # the third interval of 5 steps (15), or the next if the first was partial
    assert s["phase_ms"] - s["median_phase_ms"] > 60, s  # half of the 200 ms against the median of two
    assert "straggler: rank 1 on" in out and "slowest phase compute" in out
    # Rank 0 waits for rank 1 in the gradient all-reduce: that is comm, not its own work.
    ranks = metrics(run_dir, "ranks")
    med = lambda rank, phase: sorted(x["ranks"][rank]["phase_ms"][phase] for x in ranks)[len(ranks) // 2]  # noqa: E731
    assert med(0, "comm") > 40 and med(0, "comm") > med(1, "comm") + 30, ranks
    # The drill only sleeps, and the communication hook is PyTorch's default all-reduce: the same
    # parameters as a run with the timings off.
    off = tmp_path / "off"
    assert torchrun(2, f"run.dir={off}", *RANKS_RUN, "observe.ranks=false").returncode == 0
    assert metrics(off, "ranks") == [] and metrics(off, "straggler") == []
    assert inspect(off)["params_sha256"] == inspect(run_dir)["params_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["compute", pytest.param("data", marks=pytest.mark.e2e),
                                   pytest.param("optim", marks=pytest.mark.e2e)])
def test_a_slowed_rank_is_named_a_straggler_under_fsdp_too(tmp_path, phase):
    """FSDP's all-gathers and reduce-scatters run inside the forward and backward: rank 0's waits there
    for the slowed rank 1 (and in the buffers' broadcast after the optimizer) are comm, not its work."""
    r = torchrun(2, f"run.dir={tmp_path}", *RANKS_RUN, "parallel.strategy=fsdp", "drill.slow_rank=1",
                 "drill.slow_ms=200", f"drill.slow_phase={phase}", "observe.straggler_intervals=3")
    assert r.returncode == 0, r.output[-3000:]
    found = metrics(tmp_path, "straggler")
    _named_once_per_streak(found, phase)
    ranks = metrics(tmp_path, "ranks")
    busy = lambda rank: sorted(x["ranks"][rank]["busy_ms"] for x in ranks)[len(ranks) // 2]  # noqa: E731
    # Rank 1's own work is about the 200 ms drill over rank 0's; before the waits were split out, the two
    # ranks' busy times were the same. Over half the drill: with the other lane of `make test` beside it,
    # rank 0's own work stretches too (124 ms over it seen once, 140 the earlier bound).
    assert 100 < busy(1) - busy(0) < 280, ranks
    comm = lambda rank: sorted(x["ranks"][rank]["phase_ms"]["comm"] for x in ranks)[len(ranks) // 2]  # noqa: E731
    assert comm(0) > comm(1) + 40, ranks
    if phase == "optim":  # the wrapped FSDP methods and the drill's sleeps change no number
        off = tmp_path / "off"
        assert torchrun(2, f"run.dir={off}", *RANKS_RUN, "parallel.strategy=fsdp",
                        "observe.ranks=false").returncode == 0
        assert inspect(off)["params_sha256"] == inspect(tmp_path)["params_sha256"]


def test_fsdp_internals_torch_moved_are_found_missing_not_an_error():
    """The backward's waits are timed through FSDP's private parameter groups: where torch lays them out
    otherwise, `time_waits` warns and training goes on with the backward's waits counted as compute."""
    from trainapp.core.parallel import fsdp

    assert fsdp._param_groups([torch.nn.Linear(2, 2)]) is None


# ----------------------------------------------------------------------------------------------
# TensorBoard (observe.tensorboard)

def test_tensorboard_without_the_package_is_one_line_naming_the_extra(monkeypatch):
    from trainapp.config import ConfigError
    from trainapp.observe import tboard

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    with pytest.raises(ConfigError) as e:
        tboard.check()
    assert str(e.value) == ("observe.tensorboard=true needs the tensorboard package: pip install "
                            "'trainapp[tensorboard]' (or set observe.tensorboard=false)")
