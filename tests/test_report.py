"""`trainapp report`: plots and a summary of a run with a restart; the same run's TensorBoard files."""

from __future__ import annotations

import pytest
from helpers import trainapp

from trainapp.tools import report, timeline_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def restarted_run(torchrun_restarted):
    """The session's shared torchrun run with a restart (conftest.py): killed at step 13, resumed at 10."""
    return torchrun_restarted


@pytest.mark.slow
def test_report_plots_and_summarizes_a_run_with_a_restart(restarted_run, tmp_path):
    out = tmp_path / "plots" / "run.png"
    r = trainapp("report", str(restarted_run), "--out", str(out), timeout=120)
    assert r.returncode == 0, r.output
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    summary = out.with_suffix(".txt").read_text()
    assert summary.strip() in r.stdout
    assert "finished at step 24 of 24 planned" in summary
    restart = "restarts       1: resumed at 10 from storage after 13 (3 redone, world size 2)"
    assert restart in summary, summary
    assert "val_acc        final" in summary and "snapshots      " in summary
    # Both ranks' timings, over both attempts (log_every=1: a ranks record per step).
    assert "ranks          2; median step" in summary and "stragglers     none" in summary, summary
    assert " ms of CPU; fastest rank" in summary, summary  # each rank measured its process's CPU time
    steps = [r["step"] for r in report.read(restarted_run) if r["kind"] == "ranks"]
    assert steps[:13] == list(range(1, 14)) and steps[13] == 11, steps  # resumed from step 10


def test_the_summary_names_the_slowest_rank_its_phase_and_the_stragglers():
    def entry(rank, compute, comm):
        phase_ms = {"data": 1.0, "compute": compute, "comm": comm, "optim": 2.0, "snapshot": 0.0,
                    "other": 0.5}
        return {"rank": rank, "host": f"h{rank}", "step_ms": 100.0, "busy_ms": 100.0 - comm,
                "phase_ms": phase_ms}

    ranks = {"kind": "ranks", "step": 5, "ranks": [entry(0, 30.0, 66.5), entry(1, 90.0, 6.5)]}
    straggler = {"kind": "straggler", "step": 15, "rank": 1, "host": "h1", "ratio": 1.46, "phase": "compute",
                 "phase_ms": 90.0, "median_phase_ms": 60.0}
    lines = report._rank_lines([ranks, ranks, straggler])
    assert lines[0] == ("ranks          2; median step 100.0 ms; slowest rank 1 on h1: 93.5 ms "
                        "of its own work per step, most of it compute (90.0 ms); fastest rank 0: 33.5 ms")
    assert lines[1:] == ["stragglers     1", "  rank 1 on h1 from step 15: 1.46x the median step without "
                         "communication wait; compute 90.0 ms against 60.0 ms"]
    assert report._rank_lines([{"kind": "train", "step": 1}]) == []  # observe.ranks=false: no lines
    # Runs that record each rank's CPU time per step show the slowest rank's.
    for e in ranks["ranks"]:
        e["cpu_ms"] = e["busy_ms"] + 1.5
    assert report._rank_lines([ranks])[0].endswith("(90.0 ms), 95.0 ms of CPU; fastest rank 0: 33.5 ms")


@pytest.mark.slow
def test_report_without_matplotlib_says_how_to_get_it(restarted_run, tmp_path):
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    r = trainapp("report", str(restarted_run), "--out", str(tmp_path / "r.png"), timeout=120,
                 env={"PYTHONPATH": str(shadow.parent)})
    assert r.returncode == 2, r.output
    assert r.stderr.strip().splitlines()[-1] == ("trainapp report: error: matplotlib is not installed "
                                                 "(the report extra): pip install 'trainapp[report]'")


@pytest.mark.slow
def test_the_account_of_a_restarted_run_adds_up_and_counts_the_steps_redone(restarted_run):
    """The shared run: rank 1 SIGKILLed after step 13, the group restarted from the step-10 snapshot."""
    from trainapp.observe import goodput

    acc = goodput.account(report.read(restarted_run))
    bad = acc["badput_s"]
    assert acc["steps_redone"] == 3 and bad["redone"] > 0 and bad["restart"] > 0 and bad["startup"] > 0
    assert [a["ended_by"] for a in acc["attempts"]] == ["failure", "end"]
    total = acc["goodput_s"] + sum(bad.values())
    # by construction, `other` included (each cause rounded to 1 ms)
    assert abs(total - acc["wall_s"]) <= 0.01
    assert abs(bad["other"]) < 0.02 * acc["wall_s"], acc  # what the causes do not explain
    assert 0 < acc["goodput"] < 1
    # The run's end record carries the account as it stood then (the report's, a moment later, is the same
    # run).
    end = [r for r in report.read(restarted_run) if r["kind"] == "end"][-1]
    assert end["steps_redone"] == 3 and 0 < end["goodput"] < 1 and set(end["badput_s"]) == set(goodput.CAUSES)
    assert end["wall_s"] == pytest.approx(acc["wall_s"], abs=0.5)


def test_report_of_a_directory_without_metrics_is_bad_input(tmp_path):
    r = trainapp("report", str(tmp_path), timeout=60)
    assert r.returncode == 2 and "no metrics.jsonl here" in r.stderr


@pytest.mark.slow
def test_report_draws_other_runs_over_a_runs_curves_and_names_a_bad_one(restarted_run, tmp_path):
    out = tmp_path / "compare.png"
    alone = report.run(str(restarted_run), str(tmp_path / "alone.png"))[0].stat().st_size
    report.run(str(restarted_run), str(out), compare=[str(restarted_run)])
    # more curves, a bigger legend
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > alone
    r = trainapp("report", str(restarted_run), "--out", str(out), "--compare", str(tmp_path / "nothing"),
                 timeout=60)
    assert r.returncode == 2 and f"{tmp_path / 'nothing'}: no metrics.jsonl here" in r.stderr


def test_a_rank_that_died_silently_is_named_from_ray_trains_view():
    start = {"kind": "start", "time": 1.0}
    peer = {"kind": "failure", "time": 3.0, "attempt": 0, "rank": 1, "host": "b", "step": 13, "phase": "step",
            "cause": "peer", "error": "a peer's connection closed"}
    seen = {"kind": "group_failure", "time": 4.0,
            "errors": {"0": "WorkerHealthCheckFailedError: A worker health check failed.",
                       "1": "RuntimeError: gloo"}}
    # Rank 0 was SIGKILLed and wrote nothing; rank 1 lost its peer: Ray's word on rank 0 leads.
    said = report.failures([start, peer, seen, {**start, "time": 5.0}])
    assert said == ["attempt 0: Ray Train saw rank 0: WorkerHealthCheckFailedError: A worker health check "
                    "failed.; then rank 1 peer"]
    # A rank's own record of the root cause leads; Ray's view adds only the silent rank.
    oom = {**peer, "rank": 0, "cause": "oom", "error": "OutOfMemoryError"}
    said = report.failures([start, oom, seen, {**start, "time": 5.0}])
    assert said[0].startswith("attempt 0: rank 0 on b after step 13 (phase step): oom:") and \
        said[0].endswith("; Ray Train saw rank 1: RuntimeError: gloo"), said
    # Nothing from anyone: the old line.
    assert report.failures([start, {**start, "time": 5.0}]) == [
        "attempt 0: ended without a failure record (SIGKILL: a lost node, the OOM killer)"]


def test_a_rank_hung_in_forward_and_backward_is_named_after_the_rank_that_hung_elsewhere():
    """Both watchdogs fire, in whichever order their polls fall: the rank blocked in the gradient
    all-reduce (phase compute) is waiting for the one stuck in its data loader, which leads."""
    start = {"kind": "start", "time": 1.0}
    blocked = {"kind": "failure", "time": 3.0, "attempt": 0, "rank": 0, "host": "a", "step": 17,
               "phase": "compute", "cause": "hang", "error": "no progress for 6 s"}
    stuck = {**blocked, "time": 3.4, "rank": 1, "phase": "data"}
    said = report.failures([start, blocked, stuck, {**start, "time": 5.0}])
    assert said == ["attempt 0: rank 1 on a after step 17 (phase data): hang: no progress for 6 s; "
                    "then rank 0 hang"]


@pytest.mark.slow
def test_tensorboard_files_hold_one_timeline_over_the_restart(restarted_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(list((restarted_run / "tb").glob("events.out.tfevents.*"))) == 2  # one file per attempt
    acc = EventAccumulator(str(restarted_run / "tb"))
    acc.Reload()
    assert {"train/loss", "train/lr", "eval/val_acc", "ranks/busy_ms/rank_0", "ranks/busy_ms/rank_1"} <= \
        set(acc.Tags()["scalars"])
    # Steps 11-13 ran twice (resumed from the step-10 snapshot): TensorBoard shows each step once, with
    # the value of the attempt that counts, as metrics.jsonl's last record of each step has it.
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(loss) == list(range(1, 25)), sorted(loss)
    last = {rec["step"]: rec["loss"] for rec in report.read(restarted_run) if rec["kind"] == "train"}
    assert loss == pytest.approx(last, rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/val_acc")] == [10, 20, 24]


def _timeline(fig):
    return next(ax for ax in fig.axes if ax.get_label() == timeline_plot.LABEL)


def _stretch(ax, label: str) -> tuple[float, float]:
    """The (from, to) seconds of the timeline stretch labelled `label`."""
    box = next(c for c in ax.collections if c.get_label().startswith(label)).get_paths()[0].get_extents()
    return box.x0, box.x1


def _three_attempts(loss_scale: bool = False) -> list[dict]:
    """A run on the clock: a step a second (global batch 10 at 10 samples/s). Attempt 0 (launched at 98)
    hangs after step 10, found 10 s later; its restart resumes at 5 and is preempted after step 20; a new
    launch at 200 (nothing ran for 58 s) resumes at 20 and finishes at 30. No eval, no ranks records."""
    def start(t, launch, step, restart, job):
        return {"kind": "start", "time": t, "step": step, "resumed_step": step or None, "restart": restart,
                "global_batch": 10, "startup": {"worker_process": launch}, "lease": {"holder": {"job": job}}}

    def train(t, step):
        return {"kind": "train", "time": t, "step": step, "loss": 2.0 - step / 20, "lr": 0.1,
                "samples_per_s": 10.0, **({"loss_scale": 65536.0} if loss_scale else {})}

    return [start(100, 98, 0, 0, "torchrun:a"), train(106, 5), {"kind": "snapshot", "time": 106.1, "step": 5},
            train(111, 10), {"kind": "failure", "time": 121, "step": 10, "cause": "hang", "rank": 0},
            start(125, 123, 5, 1, "torchrun:a"), train(131, 10), train(141, 20),
            {"kind": "snapshot", "time": 141.2, "step": 20}, {"kind": "preempted", "time": 142, "step": 20},
            start(202, 200, 20, 0, "torchrun:b"), train(213, 30), {"kind": "end", "time": 213.5, "steps": 30}]


def test_the_timeline_draws_each_attempt_as_a_bar_over_the_wall_clock_with_its_marks_and_the_gap():
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer

    fig = report.figure(_three_attempts(), "three attempts")
    ax = _timeline(fig)
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert len(bars) == 1 and len(bars[0]) == 3  # one bar per attempt
    # From each launch to the attempt's last record, in seconds since the first launch (98).
    spans = [(round(b.get_x(), 6), round(b.get_x() + b.get_width(), 6)) for b in bars[0]]
    assert spans == [(0, 23), (25, 44), (102, 115.5)]  # 58 s between the second and third: a gap
    assert _stretch(ax, "start-up") == pytest.approx((0, 3))  # launch to when step 1 began
    assert _stretch(ax, "hang") == pytest.approx((13, 23))  # step 10 ended at 111, the hang found at 121
    assert _stretch(ax, "steps redone") == pytest.approx((8, 13))  # steps 6-10: the restart resumed at 5
    assert _stretch(ax, "notice") == pytest.approx((43, 44))  # step 20 ended at 141, preempted at 142
    marks = {line.get_label(): line.get_xdata() for line in ax.lines if not line.get_label().startswith("_")}
    snapshots = [x for line in ax.lines if line.get_marker() == "|" for x in line.get_xdata()]
    # named once
    assert snapshots == pytest.approx([8.1, 43.2]) and list(marks["snapshot"]) == pytest.approx([8.1])
    assert list(marks["preempted / stopped / resized"]) == pytest.approx([44])
    plt.close(fig)


def test_panels_without_data_are_left_out_not_drawn_empty():
    """An fp32 run without evaluations or per-rank timings: the timeline and three step panels, no more."""
    import matplotlib.pyplot as plt

    fig = report.figure(_three_attempts(), "fp32")
    assert [ax.get_ylabel() for ax in fig.axes[1:]] == ["loss", "samples/s", "learning rate"]
    assert [ax.get_label() for ax in fig.axes[:1]] == [timeline_plot.LABEL]
    assert fig.axes[-1].get_xlabel() == "optimizer step"  # the last panel over steps names its axis
    height = fig.get_figheight()
    plt.close(fig)
    fig = report.figure(_three_attempts(loss_scale=True), "fp16")
    assert [ax.get_ylabel() for ax in fig.axes[1:]] == ["loss", "samples/s", "learning rate",
                                                        "loss scale (fp16)"]
    assert fig.get_figheight() > height  # the figure grows with its panels
    plt.close(fig)


@pytest.mark.slow
def test_the_report_of_a_restarted_run_has_a_timeline_bar_per_attempt_and_no_loss_scale(restarted_run):
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer

    records = report.read(restarted_run)
    fig = report.figure(records, "restarted")
    ax = _timeline(fig)
    (bars,) = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert len(bars) == 2 == sum(r["kind"] == "start" for r in records)
    first, second = bars
    # the restart came after
    assert first.get_x() == 0 and second.get_x() >= first.get_x() + first.get_width()
    # 11-13, before the kill
    assert _stretch(ax, "steps redone")[1] == pytest.approx(first.get_width(), abs=1.0)
    # A bf16 run on CPU: no loss scale panel; evaluation and both ranks' timings have theirs.
    labels = [a.get_ylabel() for a in fig.axes]
    assert "loss scale (fp16)" not in labels and {"loss", "val_acc"} <= set(labels), labels
    assert len(fig.axes) == 1 + 4 + 2, labels  # timeline; loss, val_acc, samples/s, lr; rank work, phases
    plt.close(fig)


def test_the_restart_line_counts_the_steps_reached_after_the_last_train_record_as_the_account_does():
    records = [{"kind": "start", "time": 0.0, "step": 0, "world_size": 2},
               {"kind": "train", "time": 1.0, "step": 10},
               # train records come every 5 steps
               {"kind": "failure", "time": 1.5, "step": 13, "cause": "peer"},
               {"kind": "start", "time": 3.0, "step": 10, "resumed_step": 10, "world_size": 2}]
    assert report.restarts(records) == [{"resumed_step": 10, "trained_to": 13, "redone": 3, "world_size": 2,
                                         "tier": "storage"}]
