"""Live metrics (trainapp/observe/live.py): the Prometheus endpoint of a real torchrun run scraped over
real HTTP on loopback while it trains, who serves which figure, and a taken port."""

from __future__ import annotations

import socket

import pytest
from helpers import QUICK, metrics, scrape, trainapp, value

from trainapp.observe.live import LiveMetrics


class Recorder:
    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple], float] = {}

    def set(self, name, value, labels):
        self.values[(name, tuple(sorted(labels.items())))] = value

    def close(self):
        pass


def test_rank_0_alone_gives_the_runs_figures_and_each_server_only_its_own_ranks():
    entries = [{"rank": r, "step_ms": 30.0 + r, "busy_ms": 20.0, "phase_ms": {"data": 1.0}} for r in range(4)]
    record = {"step": 10, "loss": 1.5, "lr": 0.1, "samples_per_s": 900.0, "world_size": 4}
    node0, node1 = Recorder(), Recorder()
    for sink, is_main, ranks in ((node0, True, {0, 1}), (node1, False, {2, 3})):
        live = LiveMetrics(sink, "r", is_main, ranks)
        live.interval(record)
        live.rank_timings(entries, flagged={3})
        live.snapshot(10)
    assert (value(node0.values, "trainapp_step", run="r") == 10
            and value(node1.values, "trainapp_step", run="r") is None)
    assert value(node0.values, "trainapp_snapshot_step", run="r") == 10
    assert not any(k[0] == "trainapp_snapshot_step" for k in node1.values)
    ranks_of = lambda sink: sorted({dict(k[1])["rank"] for k in sink.values  # noqa: E731
                                    if k[0].startswith("trainapp_rank_")})
    assert ranks_of(node0) == ["0", "1"] and ranks_of(node1) == ["2", "3"]
    assert value(node1.values, "trainapp_straggler", run="r", rank="3") == 1.0
    assert value(node1.values, "trainapp_straggler", run="r", rank="2") == 0.0
    assert value(node0.values, "trainapp_rank_step_seconds", run="r", rank="1") == pytest.approx(0.031)


@pytest.mark.slow
def test_a_torchrun_runs_endpoint_is_scraped_over_http_while_it_trains_and_names_the_slowed_rank(slowed_run):
    """conftest.py's `slowed_run`, scraped while it trained."""
    out, scrapes, port = slowed_run.output, slowed_run.scrapes, slowed_run.port
    assert len(scrapes) >= 2, out[-3000:]
    run = slowed_run.run_dir.name
    first, last = scrapes[0], scrapes[-1]
    assert value(last, "trainapp_step", run=run) > value(first, "trainapp_step", run=run)  # values move
    assert value(last, "trainapp_total_steps", run=run) == 40
    assert (value(last, "trainapp_samples_per_second", run=run) > 0
            and value(last, "trainapp_loss", run=run) > 0)
    assert 0 < value(last, "trainapp_goodput_ratio", run=run) < 1
    assert (value(last, "trainapp_snapshot_step", run=run) % 20 == 0
            and value(last, "trainapp_snapshot_step", run=run))
    assert value(last, "trainapp_restarts", run=run) == 0
    # One server for the node's two ranks; rank 1 (slowed 200 ms a step) is flagged, rank 0 is not.
    assert value(last, "trainapp_straggler", run=run, rank="1") == 1.0
    assert value(last, "trainapp_straggler", run=run, rank="0") == 0.0
    assert value(last, "trainapp_rank_busy_seconds", run=run, rank="1") > \
        value(last, "trainapp_rank_busy_seconds", run=run, rank="0") + 0.02
    assert "metrics: http://" in out and f":{port}/metrics serves rank(s) 0,1 and the run's figures" in out
    assert scrape(port) is None  # the server went with the run


@pytest.mark.slow
def test_a_taken_port_is_one_warning_line_and_the_run_trains_on(tmp_path):
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        r = trainapp("train", f"run.dir={tmp_path}", "train.max_steps=5", f"observe.prometheus_port={port}",
                     *QUICK)
    assert r.returncode == 0, r.output[-3000:]
    lines = [ln for ln in r.output.splitlines() if f"observe.prometheus_port={port}" in ln]
    assert (len(lines) == 1
            and "this node's metrics are not served, training goes on" in lines[0]), r.output[-3000:]
    assert "Traceback" not in r.output and metrics(tmp_path, "end")
