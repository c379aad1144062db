"""slurm/train.sbatch on a real Slurm: Debian's slurmctld and two slurmd, each node in its own network
namespace with its own host name (tests/slurm_cluster.py). A job preempted by the batch signal snapshots
the step reached, requeues itself and resumes with zero steps redone, ending bitwise equal to a run that
was never stopped; a run.dir on node-local scratch and an interface no node has end the job in one line.

The real-Slurm tests (marker `slurm`) run with `make slurm-smoke`, which installs the packages; CI runs
it after `make test`. The checks of the script itself and of `trainapp slurm-preflight` run everywhere.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import helpers
import pytest
from helpers import PY, REPO, auto_resumed, inspect, metrics, run_cmd, torchrun_cmd, wait_for_step, wait_until
from test_preempt import RUN, preempt_torchrun_cmd  # the preemption tests' run; 2 ranks of it under torchrun

from trainapp.config import PreemptSection

SBATCH = REPO / "slurm" / "train.sbatch"


# --- the script --------------------------------------------------------------------------------------
def test_sbatch_parses_and_every_tunable_has_a_comment():
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = SBATCH.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# --- tunables"))
    end = next(i for i, line in enumerate(lines) if i > start and line.startswith("# ----"))
    lines = lines[start:end]
    tunables = [(i, m.group(1)) for i, line in enumerate(lines)
                if (m := re.match(r"^([A-Z_]+)=\$\{\1:-", line))]
    assert {n for _, n in tunables} >= {"RUN_DIR", "CONFIG", "ARGS", "NETWORK_INTERFACE", "VENV",
                                        "NPROC_PER_NODE", "RDZV_PORT", "MAX_RESTARTS", "MAX_REQUEUES"}
    for i, name in tunables:
        above = lines[i - 1]
        assert above.startswith("#") or re.match(r"^[A-Z_]+=\$\{", above), f"{name} has no comment above it"


def test_shellcheck_reports_nothing():
    shellcheck = REPO / ".venv-tools" / "bin" / "shellcheck"
    if not shellcheck.exists():
        pytest.skip(f"{shellcheck} missing: make tools installs it")
    r = subprocess.run([str(shellcheck), "--severity=info", str(SBATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_sbatch_requeues_and_signals_early_enough_for_the_grace_period():
    text = SBATCH.read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert "requeue" in sbatch and sbatch["open-mode"] == "append" and sbatch["ntasks-per-node"] == "1"
    m = re.fullmatch(r"B:USR1@(\d+)", sbatch["signal"])
    assert m, sbatch["signal"]  # to the batch shell: torchrun's agent would die of a USR1 of its own
    # The notice must leave room for the grace period, one step and the snapshot before the time limit.
    assert int(m.group(1)) >= PreemptSection().grace_s + 60


def _preflight(tmp: Path, *args: str, job: str = "7", restart: str = "0") -> helpers.Result:
    env = {"SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": restart, "SLURMD_NODENAME": "nodeX"}
    code = ("import sys; from trainapp import cli; rc = cli.main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'the preflight imported torch'; sys.exit(rc)")
    return run_cmd([PY, "-c", code, "slurm-preflight", f"run.dir={tmp / 'run'}", *args], env=env, timeout=60)


def test_preflight_marks_then_checks_without_torch(tmp_path):
    r = _preflight(tmp_path, "--mark")
    assert r.returncode == 0 and "written by node nodeX" in r.stdout, r.output
    assert (tmp_path / "run" / ".slurm-job").read_text().split() == ["7.0", "nodeX"]
    r = _preflight(tmp_path, "--rendezvous", "127.0.0.1")
    assert r.returncode == 0 and "node nodeX ok" in r.stdout, r.output


@pytest.mark.parametrize("case", ["no-marker", "other-attempt", "interface", "rendezvous"])
def test_preflight_failures_are_one_line_naming_node_key_and_fix(tmp_path, case):
    if case != "no-marker":
        assert _preflight(tmp_path, "--mark").returncode == 0
    args = {"no-marker": [], "other-attempt": [], "interface": ["network.interface=ib0"],
            "rendezvous": []}[case]
    rdzv = "no-such-host.invalid" if case == "rendezvous" else "127.0.0.1"
    r = _preflight(tmp_path, *args, "--rendezvous", rdzv, restart="1" if case == "other-attempt" else "0")
    assert r.returncode == 2 and r.stdout == "", r.output
    (line,) = r.stderr.strip().splitlines()
    want = {"no-marker": f"run.dir={tmp_path / 'run'}: not storage every node sees",
            "other-attempt": "node nodeX finds 7.0 from nodeX",
            "interface": "network.interface=ib0: host nodeX has no interface ib0",
            "rendezvous": "rendezvous host no-such-host.invalid does not resolve on node nodeX"}[case]
    assert line.startswith("trainapp slurm-preflight: error: ") and want in line, line
    assert "Traceback" not in r.stderr


# --- a real Slurm ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    import slurm_cluster

    why = slurm_cluster.unavailable()
    if why:
        pytest.skip(why)
    cluster = slurm_cluster.Slurm(tmp_path_factory.mktemp("slurm")).up()
    yield cluster
    cluster.down()


def submit(slurm, tmp: Path, name: str, via_make: bool = False, **env: str) -> tuple[str, Path]:
    out = tmp / f"{name}.out"
    env = {"OMP_NUM_THREADS": "1", **env}
    if not via_make:
        return slurm.sbatch(f"--job-name={name}", f"--output={out}", str(SBATCH), env=env, cwd=REPO), out
    args = env.pop("ARGS")  # what a user types: make slurm-submit ARGS=... RUN_DIR=...
    r = slurm.run("make", "slurm-submit", f"ARGS={args}", f"RUN_DIR={env.pop('RUN_DIR')}",
                  f"SBATCH_ARGS=--job-name={name} --output={out}", env=env, cwd=REPO)
    return re.search(r"Submitted batch job (\d+)", r.stdout).group(1), out


def job_ended(slurm, job: str) -> str | None:
    """For `wait_for_step(gone=...)`: why the job is no longer pending or running, None while it is."""
    state = slurm.job(job)["JobState"]
    return None if state in ("PENDING", "RUNNING") else f"job {job}: {state} first\n{slurm.logs()}"


def stop_mid_run(slurm, tmp: Path, name: str, notice, extra: tuple[str, ...] = (), at_step: int = 30,
                 every: int = 100) -> tuple[Path, dict, str, dict]:
    """Submit the run (RUN + `extra`), call `notice(job)` after step `at_step`, wait for the job to end:
    (run dir, the job's final info, its output, the `preempted` record). Its snapshot is the notice's
    own, not a periodic one (every `every` steps)."""
    run_dir = tmp / "run"
    job, out = submit(slurm, tmp, name, RUN_DIR=str(run_dir), ARGS=" ".join([*RUN, *extra]))
    wait_for_step(run_dir, at_step, 180, gone=lambda: job_ended(slurm, job), interval=0.1)
    notice(job)
    info = slurm.wait_job(job, timeout=300)
    (pre,) = metrics(run_dir, "preempted")
    assert pre["signal"] == "SIGTERM" and pre["step"] >= at_step and pre["step"] % every, pre
    return run_dir, info, out.read_text(), pre


def shorten_the_time_limit(slurm, job: str) -> None:
    """Slurm's own timer: a limit of 1 minute from the job's start is nearer than the 120 s of
    --signal=B:USR1@120, so slurmctld sends USR1 at its next time-limit check (every 30 s). Once the
    job is requeued, give it room to finish."""
    slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=1")
    wait_until(lambda: slurm.job(job)["Restarts"] != "0", "a requeue after the time limit was shortened", 120,
               interval=0.5)
    slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.parametrize("how", ["scancel-batch-usr1", "time-limit"])
def test_a_preempted_job_requeues_itself_and_resumes_with_zero_steps_redone(slurm, straight_sha, tmp_path,
                                                                            how):
    if how == "time-limit":  # steps of 300 ms (a sleep, no change to the numbers) outlast Slurm's 30 s check
        run_dir, info, text, pre = stop_mid_run(
            slurm, tmp_path, how, lambda job: shorten_the_time_limit(slurm, job), at_step=10, every=1000,
            extra=("drill.slow_rank=0", "drill.slow_ms=300", "snapshot.every_steps=1000"))
    else:  # what --signal=B:USR1@N sends before the time limit, sent by hand
        run_dir, info, text, pre = stop_mid_run(
            slurm, tmp_path, how, lambda job: slurm.run("scancel", "--batch", "--signal=USR1", job))
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-4000:])
    assert info["Restarts"] == "1", info  # requeued once, by the script itself
    assert f"snapshot {run_dir}/snapshots/step_{pre['step']:09d}" in text
    first, second = metrics(run_dir, "start")
    assert first["resumed_step"] is None and second["resumed_step"] == pre["step"] == second["step"]
    # The requeued job takes the run's lease as the job it is, quietly (trainapp/snapshots/lease.py).
    assert (second["lease"]["generation"] == first["lease"]["generation"] + 1
            and second["lease"]["took_over"] is None)
    assert first["lease"]["holder"]["job"] == second["lease"]["holder"]["job"] != ""
    assert first["lease"]["holder"]["job"].startswith("slurm:")
    assert (first["lease"]["holder"]["requeue"], second["lease"]["holder"]["requeue"]) == (0, 1)
    # The goodput account: the requeue's wait is time between attempts, not a restart of the same job.
    (end,) = metrics(run_dir, "end")
    assert (end["badput_s"]["between_attempts"] > 0 and end["badput_s"]["restart"] == 0
            and end["steps_redone"] == 0)
    for start in (first, second):  # two nodes, one rank each, over the nodes' own link
        assert [(p["host"], p["node_rank"], p["local_rank"]) for p in start["placement"]] == [
            ("node1", 0, 0), ("node2", 1, 0)], start["placement"]
        assert {n["gloo"] for n in start["network"]} == {"trn0"}
    steps = [r["step"] for r in metrics(run_dir, "train")]
    assert len(steps) == len(set(steps)) and max(steps) == 200  # zero steps redone, none missing
    straight = straight_sha(preempt_torchrun_cmd)  # the same run on one machine, never stopped
    assert inspect(run_dir)["params_sha256"] == straight
    # run.export, at the end of run 1
    exported = json.loads((run_dir / "model" / "trainapp.json").read_text())
    assert exported["step"] == 200 and exported["source"]["params_sha256"] == straight, exported
    assert ("run 0: got SIGUSR1" in text and "requeueing" in text
            and "run 1: training ended with exit 0" in text)


@pytest.mark.slow
@pytest.mark.slurm
def test_scancel_snapshots_and_the_same_run_dir_resumes_in_a_new_job(slurm, straight_sha, tmp_path):
    # scancel: SIGTERM to every process of the job
    run_dir, info, text, pre = stop_mid_run(slurm, tmp_path, "cancel", lambda job: slurm.run("scancel", job))
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    assert inspect(run_dir)["global_step"] == pre["step"] and "stopped by SIGTERM" in text, text[-3000:]
    assert "scancel: error" not in text, text[-3000:]

    job2, out2 = submit(slurm, tmp_path, "again", RUN_DIR=str(run_dir), ARGS=" ".join(RUN))
    info = slurm.wait_job(job2, timeout=300)
    assert info["JobState"] == "COMPLETED", (info, out2.read_text()[-3000:])
    assert metrics(run_dir, "start")[-1]["resumed_step"] == pre["step"]
    assert inspect(run_dir)["params_sha256"] == straight_sha(preempt_torchrun_cmd)


FSDP_RUN = ("parallel.strategy=fsdp", "train.max_steps=40")  # sharded, and shorter: its straight run is extra


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_killed_rank_is_restarted_inside_the_allocation_by_torchrun(slurm, straight_sha, tmp_path,
                                                                       strategy):
    """Rank 1 (on node2) SIGKILLs itself after step 13: both nodes' torchrun agents meet again at the
    rendezvous on node1, and the group resumes in the same job from the memory tier (the default, `auto`)
    where its copy is at least as new as the storage snapshot of step 10. Under FSDP each node's rank keeps
    its shards in memory, and writes them into the shared RUN_DIR for the storage snapshots."""
    run_dir = tmp_path / "run"
    extra = FSDP_RUN if strategy == "fsdp" else ()
    job, out = submit(slurm, tmp_path, f"crash-{strategy}", RUN_DIR=str(run_dir),
                      ARGS=" ".join([*RUN, "snapshot.every_steps=10", "drill.kill_at_step=13", "drill.rank=1",
                                     *extra, "snapshot.memory_every_steps=auto"]))
    info = slurm.wait_job(job, timeout=300)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", (info, text[-4000:])
    first, second = metrics(run_dir, "start")  # one per attempt
    assert first["resumed_step"] is None, first
    assert (second["resumed_tier"], second["resumed_step"]) == auto_resumed(text, 10, 13), second
    assert {(p["host"], p["node_rank"]) for p in second["placement"]} == {("node1", 0), ("node2", 1)}
    if strategy == "ddp":
        assert inspect(run_dir)["params_sha256"] == straight_sha(preempt_torchrun_cmd)
        return
    meta = json.loads((run_dir / "snapshots" / "step_000000040" / "meta.json").read_text())
    assert {"shards/__0_0.distcp", "shards/__1_0.distcp"} <= set(meta["shards"]), meta
    assert inspect(run_dir)["params_sha256"] == straight_sha(preempt_torchrun_cmd, *FSDP_RUN)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.parametrize("case", ["node-local-run-dir", "missing-interface"])
def test_bad_input_ends_the_job_with_one_line_and_no_requeue(slurm, tmp_path, case):
    if case == "node-local-run-dir":  # each node has its own tmpfs there, as /scratch on real nodes
        env, want = {"RUN_DIR": str(slurm.scratch / "run")}, "not storage every node sees"
    else:
        env, want = {"RUN_DIR": str(tmp_path / "run"), "NETWORK_INTERFACE": "ib0"}, "has no interface ib0"
    job, out = submit(slurm, tmp_path, case, via_make=case == "missing-interface", ARGS=" ".join(RUN), **env)
    info = slurm.wait_job(job, timeout=120)
    text = out.read_text()
    assert (info["JobState"] == "FAILED" and info["ExitCode"] == "2:0"
            and info["Restarts"] == "0"), (info, text)
    errors = [line for line in text.splitlines() if "slurm-preflight: error" in line]
    assert errors and all(want in line and "node" in line for line in errors), text
    assert "not requeued" in text and "Traceback" not in text and "[rank 0]" not in text, text


# Polls each node's live metrics endpoint from the controller's namespace until both served a rank's
# figures and the step moved on node1 (rank 0's); prints what it saw as JSON.
SCRAPER = """
import json, sys, time, urllib.request
port, hosts, seen = int(sys.argv[1]), sys.argv[2:], {}
deadline = time.monotonic() + 240
while time.monotonic() < deadline:
    for h in hosts:
        try:
            text = urllib.request.urlopen(f"http://{h}:{port}/metrics", timeout=1).read().decode()
        except OSError:
            continue
        lines = [ln for ln in text.splitlines() if ln.startswith("trainapp_")]
        seen.setdefault(h, [])
        if lines and lines != (seen[h] or [[]])[-1]:
            seen[h].append(lines)
    steps = {ln for s in seen.get(hosts[0], []) for ln in s if ln.startswith("trainapp_step{")}
    if len(steps) >= 2 and all(any("rank_step_seconds" in ln for s in seen.get(h, []) for ln in s) for h in hosts):
        break
    time.sleep(0.05)
print(json.dumps(seen))
"""  # noqa: E501


@pytest.mark.slow
@pytest.mark.slurm
def test_a_user_task_on_pythonpath_trains_across_two_nodes_to_torchruns_parameters(slurm, tmp_path):
    """examples/tabular's task, not installed anywhere: on PYTHONPATH, which sbatch exports to the job.
    Each node serves its rank's live metrics (observe.prometheus_port), scraped over the nodes' network."""
    example = str(REPO / "examples" / "tabular")
    task = ["task.name=tabular_task:Regression", "task.args.hidden=32", "task.args.train_rows=2048",
            "optim.name=adamw", "optim.lr=0.003", "train.max_steps=60", "train.epochs=60",
            "train.progress=false", "snapshot.every_steps=10", "train.log_every=5"]
    run_dir, port = tmp_path / "run", 19463
    scraper = subprocess.Popen([*slurm.prefix(slurm.ctl), PY, "-c", SCRAPER, str(port),
                                *(n.train_ip for n in slurm.nodes)], stdout=subprocess.PIPE, text=True)
    job, out = submit(slurm, tmp_path, "usertask", RUN_DIR=str(run_dir),
                      ARGS=" ".join([*task, f"observe.prometheus_port={port}"]), PYTHONPATH=example)
    info = slurm.wait_job(job, timeout=300)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED", (info, text[-4000:])
    seen = json.loads(scraper.communicate(timeout=240)[0])
    node1, node2 = (seen.get(n.train_ip, []) for n in slurm.nodes)
    assert len({ln for s in node1 for ln in s if ln.startswith("trainapp_step{")}) >= 2, seen  # moving
    assert (any('rank="0"' in ln for s in node1 for ln in s)
            and not any('rank="1"' in ln for s in node1 for ln in s))
    assert any('rank="1"' in ln for s in node2 for ln in s), seen  # node2 serves its own rank
    assert not any(ln.startswith("trainapp_step{") for s in node2 for ln in s)  # the run's figures: rank 0's
    assert "trainapp: done steps=60" in text and "val_mse=" in text, text[-3000:]
    assert {p["host"] for p in metrics(run_dir, "start")[0]["placement"]} == {"node1", "node2"}
    r = run_cmd(torchrun_cmd(2, f"run.dir={tmp_path / 'tr'}", *task), env={"PYTHONPATH": example})
    assert r.returncode == 0, r.output[-3000:]
    assert inspect(run_dir)["params_sha256"] == inspect(tmp_path / "tr")["params_sha256"]
