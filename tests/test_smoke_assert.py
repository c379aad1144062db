"""scripts/smoke_assert.py on synthetic run directories: a run that lost a worker, resumed from its
newest snapshot and finished passes every check; each way a restart can go wrong fails the check
that names it. No training: metrics.jsonl and step_XXXXXXXXX/meta.json are written by hand, in the
format trainapp writes them (trainapp/core/loop.py: `start` records carry `config`, `total_steps` and
`resumed_step`; `train` records the optimizer `step`; `end` the final `steps`)."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

SCRIPT = REPO / "scripts" / "smoke_assert.py"
_spec = importlib.util.spec_from_file_location("smoke_assert", SCRIPT)
smoke_assert = importlib.util.module_from_spec(_spec)
sys.modules["smoke_assert"] = smoke_assert  # dataclasses look their module up there
_spec.loader.exec_module(smoke_assert)

EVERY, TOTAL = 10, 60  # snapshot.every_steps and the planned steps, as in scripts/kind-smoke.sh
CHECKS = ["finished", "restarted", "resumed-latest", "redone", "final-step"]


def write_run(run_dir: Path, segments: list[tuple[int | None, int]], *, every: int = EVERY,
              total: int = TOTAL, log_every: int = 1, finished: bool = True,
              snapshots: list[int] | None = None, layout: str = "ray", tier: str | None = None) -> Path:
    """A run directory: one `start` record per (resumed_step, last step trained) segment, `train`
    records every log_every steps, an `end` record if finished, and a snapshot (meta.json) at every
    multiple of `every` that was reached, plus the final step (or exactly `snapshots`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {"snapshot": {"every_steps": every, "keep": 3},
              "train": {"log_every": log_every, "max_steps": None}}
    records = []
    for resumed, last in segments:
        first = (resumed or 0) + 1
        records.append({"kind": "start", "step": resumed or 0, "world_size": 2, "total_steps": total,
                        "resumed_step": resumed, "resumed_tier": None if resumed is None else tier,
                        "resumed_from": None if resumed is None else f"step_{resumed:09d}", "config": config})
        records += [{"kind": "train", "step": s, "loss": 1.0 / s} for s in range(first, last + 1)
                    if s % log_every == 0 or s == total]
    if finished:
        resumed, last = segments[-1]
        records.append({"kind": "end", "steps": last, "steps_this_run": last - (resumed or 0)})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    reached = max(last for _, last in segments)
    steps = snapshots if snapshots is not None else \
        sorted({s for s in range(every, reached + 1, every)} | ({reached} if finished else set()))
    base = run_dir / "snapshots" if layout == "torchrun" else run_dir
    for step in steps:
        d = base / f"step_{step:09d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"global_step": step, "epoch": 0, "world_size": 2}))
    return run_dir


def failed(run_dir: Path, expect_steps: int | None = None) -> dict[str, str]:
    """{check name: detail} of the failed checks."""
    checks = smoke_assert.check_run(run_dir, expect_steps)
    assert [c.name for c in checks] == CHECKS or [c.name for c in checks] == ["metrics"]
    return {c.name: c.detail for c in checks if not c.ok}


def exit_code(run_dir: Path, *args: str) -> int:
    return smoke_assert.main([str(run_dir), "--backend", "docker", *args])


# ------------------------------------------------------------------------------------- a good run


def test_a_run_that_resumed_from_its_newest_snapshot_and_finished_passes(tmp_path):
    run = write_run(tmp_path / "run", [(None, 25), (20, TOTAL)])
    assert failed(run) == {}
    assert smoke_assert.main([str(run)]) == 0
    out = io.StringIO()  # report()'s default stream is bound at import, so capsys does not see it
    assert smoke_assert.report(smoke_assert.check_run(run), run, out=out)
    out = out.getvalue()
    assert f"smoke_assert: PASS 5 of 5 checks in {run}" in out
    assert "PASS resumed-latest: trained to 25, resumed 20 (snapshot every 10)" in out


def test_a_restart_the_memory_tier_resumed_from_the_last_step_reached_passes_and_an_older_one_fails(tmp_path):
    good = write_run(tmp_path / "good", [(None, 26), (26, TOTAL)], tier="memory")
    assert failed(good) == {}
    bad = write_run(tmp_path / "bad", [(None, 26), (12, TOTAL)], tier="peer")
    assert failed(bad)["resumed-latest"] == "trained to 26 but resumed 12 from peer, expected 20 or newer"


def test_two_restarts_and_the_torchrun_layout_pass(tmp_path):
    run = write_run(tmp_path / "run", [(None, 25), (20, 37), (30, TOTAL)], layout="torchrun")
    assert failed(run) == {}
    assert exit_code(run) == 0


def test_a_failure_right_at_a_snapshot_step_may_resume_from_the_one_before(tmp_path):
    """Step 20's record is written before its snapshot: a failure in between leaves step 10 as the
    newest complete snapshot, which expected_resume allows."""
    run = write_run(tmp_path / "run", [(None, 20), (10, TOTAL)])
    assert failed(run) == {}


def test_a_snapshot_newer_than_the_last_train_record_is_allowed(tmp_path):
    """With train.log_every=4 the records stop at step 28, but step 30 ran and saved a snapshot
    before the failure at step 31: resuming from 30 is right."""
    run = write_run(tmp_path / "run", [(None, 31), (30, TOTAL)], log_every=4)
    assert failed(run) == {}


def test_a_torn_last_line_is_skipped(tmp_path):
    run = write_run(tmp_path / "run", [(None, 25), (20, TOTAL)])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')
    assert failed(run) == {}


# ------------------------------------------------------------------------------------- each failure


def test_a_run_without_a_restart_fails_restarted(tmp_path):
    run = write_run(tmp_path / "run", [(None, TOTAL)])
    bad = failed(run)
    assert set(bad) == {"restarted", "resumed-latest", "redone"}  # the last two have nothing to check
    assert "1 `start` record(s) and none resumed" in bad["restarted"]
    assert exit_code(run) == 1


def test_a_restart_from_scratch_fails_restarted(tmp_path):
    run = write_run(tmp_path / "run", [(None, 5), (None, TOTAL)])
    assert set(failed(run)) == {"restarted"}
    assert exit_code(run) == 1


def test_resuming_from_an_older_snapshot_than_the_newest_fails_resumed_latest(tmp_path):
    # Trained to 25, so step 20 was the newest snapshot; 10 is one too old. (Resuming one snapshot too
    # early always redoes more than every_steps too, so `redone` fails with it.)
    run = write_run(tmp_path / "run", [(None, 25), (10, TOTAL)])
    bad = failed(run)
    assert set(bad) == {"resumed-latest", "redone"}
    assert bad["resumed-latest"] == "trained to 25 but resumed 10, expected 20"
    assert exit_code(run) == 1


def test_redoing_more_than_every_steps_fails_redone(tmp_path):
    run = write_run(tmp_path / "run", [(None, 38), (20, TOTAL)])
    bad = failed(run)
    assert "redone" in bad and bad["redone"].startswith("18 step(s) redone at most (limit 10")
    assert exit_code(run) == 1


def test_a_run_that_did_not_finish_fails_finished(tmp_path):
    run = write_run(tmp_path / "run", [(None, 25), (20, 48)], finished=False)
    bad = failed(run)
    assert set(bad) == {"finished", "final-step"}  # its newest snapshot is step 40 of 60
    assert bad["finished"] == "no `end` record after the last of 2 `start` records"
    assert exit_code(run) == 1


def test_an_end_record_before_the_last_start_does_not_count(tmp_path):
    run = write_run(tmp_path / "run", [(None, 25), (20, TOTAL)])
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines.append(json.dumps({"kind": "start", "step": TOTAL, "resumed_step": TOTAL, "total_steps": TOTAL}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert set(failed(run)) == {"finished"}


def test_a_final_snapshot_short_of_the_planned_steps_fails_final_step(tmp_path):
    run = write_run(tmp_path / "run", [(None, 25), (20, TOTAL)], snapshots=[10, 20, 30, 40, 50])
    assert failed(run) == {"final-step": f"newest snapshot at global_step=50, planned {TOTAL}"}
    assert exit_code(run) == 1


def test_expect_steps_overrides_the_planned_total(tmp_path):
    run = write_run(tmp_path / "run", [(None, 25), (20, TOTAL)])
    assert set(failed(run, expect_steps=TOTAL + 10)) == {"final-step"}
    assert exit_code(run, "--expect-steps", str(TOTAL + 10)) == 1
    assert exit_code(run, "--expect-steps", str(TOTAL)) == 0


def test_no_snapshot_at_all_fails_final_step(tmp_path):
    run = write_run(tmp_path / "run", [(None, 25), (20, TOTAL)], snapshots=[])
    assert failed(run)["final-step"].startswith("no snapshot step_*/meta.json")


def test_a_missing_or_empty_metrics_file_fails(tmp_path):
    assert [c.name for c in smoke_assert.check_run(tmp_path / "nothing")] == ["metrics"]
    assert exit_code(tmp_path / "nothing") == 1
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    checks = smoke_assert.check_run(tmp_path / "empty")
    assert len(checks) == 1 and not checks[0].ok and "no `start` record" in checks[0].detail
    out = io.StringIO()
    assert not smoke_assert.report(checks, tmp_path / "empty", out=out)
    assert "smoke_assert: FAIL 1 of 1 checks (metrics)" in out.getvalue()


# ------------------------------------------------------------------------------------- a preempted run

PREEMPTED_CHECKS = ["finished", "restarted", "preempted", "resumed-preempted", "final-step"]


def write_preempted_run(run_dir: Path, stop: int, resumed: int | None, *, signal: str = "SIGTERM") -> Path:
    """A run stopped by a notice at step `stop` (its `preempted` record and the snapshot of that step,
    as trainapp/core/loop.py writes them) whose restart resumed from `resumed`, then finished."""
    write_run(run_dir, [(None, stop), (resumed, TOTAL)],
              snapshots=sorted({*range(EVERY, TOTAL + 1, EVERY), stop}))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    second = [i for i, line in enumerate(lines) if json.loads(line)["kind"] == "start"][1]
    lines.insert(second, json.dumps({"kind": "preempted", "step": stop, "signal": signal, "seconds": 1.2,
                                     "phase": "train", "snapshot": str(run_dir / f"step_{stop:09d}")}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def failed_preempted(run_dir: Path, signal: str = "SIGTERM") -> dict[str, str]:
    checks = smoke_assert.check_run(run_dir, preempted=signal)
    assert [c.name for c in checks] == PREEMPTED_CHECKS
    return {c.name: c.detail for c in checks if not c.ok}


def test_a_run_preempted_by_sigterm_that_resumed_from_its_stop_step_passes(tmp_path):
    run = write_preempted_run(tmp_path / "run", stop=27, resumed=27)
    assert failed_preempted(run) == {}
    assert failed_preempted(run, "TERM") == {}  # the SIG prefix is optional
    out = io.StringIO()
    assert smoke_assert.report(smoke_assert.check_run(run, preempted="SIGTERM"), run, out=out)
    assert "PASS resumed-preempted: preempted at step 27, resumed 27: 0 steps redone" in out.getvalue()
    assert exit_code(run, "--preempted", "SIGTERM") == 0
    # The kill checks would fail it: step 27 is no multiple of snapshot.every_steps.
    assert "resumed-latest" in failed(run)


def test_a_preempted_run_that_redid_steps_fails_resumed_preempted(tmp_path):
    # The notice's snapshot (27) was not used: the restart went back to the periodic one (20).
    run = write_preempted_run(tmp_path / "run", stop=27, resumed=20)
    assert failed_preempted(run) == {
        "resumed-preempted": "preempted at step 27 but resumed 20 (7 step(s) redone, expected 0)"}
    assert exit_code(run, "--preempted", "SIGTERM") == 1


def test_a_run_without_a_preempted_record_or_with_another_signal_fails_preempted(tmp_path):
    killed = write_run(tmp_path / "killed", [(None, 25), (20, TOTAL)])
    bad = failed_preempted(killed)
    assert set(bad) == {"preempted", "resumed-preempted"}
    assert bad["preempted"].startswith("no `preempted` record")
    assert exit_code(killed, "--preempted", "SIGTERM") == 1
    sigint = write_preempted_run(tmp_path / "sigint", stop=27, resumed=27, signal="SIGINT")
    assert set(failed_preempted(sigint)) == {"preempted"}


# ------------------------------------------------------------------------------------- backends


def test_kind_backend_checks_the_copy_it_fetched(tmp_path, monkeypatch):
    good = write_run(tmp_path / "pod" / "smoke", [(None, 25), (20, TOTAL)])
    calls = []

    def fake_fetch(remote, dest, namespace, context, pod, selector, container):
        calls.append((remote, namespace, context, selector))
        return good

    monkeypatch.setattr(smoke_assert, "fetch_kind", fake_fetch)
    rc = smoke_assert.main(["/mnt/runs/smoke", "--backend", "kind", "--context", "kind-x",
                            "--dest", str(tmp_path / "copy")])
    assert rc == 0
    assert calls == [("/mnt/runs/smoke", "trainapp", "kind-x", "app.kubernetes.io/component=ray-head")]


def test_kind_backend_fails_when_the_copy_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl
    assert smoke_assert.main(["/mnt/runs/smoke", "--backend", "kind", "--dest", str(tmp_path)]) == 1
    assert "FAIL fetch: cannot copy /mnt/runs/smoke" in capsys.readouterr().out


def test_the_script_runs_standalone_with_any_python3(tmp_path):
    run = write_run(tmp_path / "run", [(None, 25), (20, TOTAL)])
    for args, rc in (([], 0), (["--expect-steps", "99"], 1)):
        r = subprocess.run([sys.executable, "-I", str(SCRIPT), str(run), *args], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == rc, r.stdout + r.stderr


@pytest.mark.parametrize("before, every, log_every, allowed", [
    (25, 10, 1, [20]),
    (20, 10, 1, [20, 10]),   # failed while step 20's snapshot was being written
    (5, 10, 1, [0]),         # before the first snapshot: start over
    (25, 10, 10, [30, 20]),  # up to 9 unrecorded steps after 25
])
def test_expected_resume_allows_the_newest_snapshot_and_the_documented_tolerances(before, every, log_every,
                                                                                  allowed):
    assert smoke_assert.expected_resume(before, every, log_every) == allowed
