"""Launchers and recovery: the same trainapp config under torchrun and under Ray Train on a local
multi-node Ray cluster (head + 2 worker nodes, 1 CPU each, on loopback).

Measured from the runs' own metrics.jsonl (wall-clock `time`; a record every `train.log_every` steps,
every step in the fault runs):
- startup: seconds from launching (`torchrun ...` / `ray job submit ...`) until the first optimizer
  step begins;
- steady-state step time: the median over a run's log intervals (trainapp's default of one record
  per 10 steps) of global batch / `samples_per_s`, which leaves snapshot and eval time out; in rounds
  of torchrun, Ray, torchrun back to back, `ray_vs_torchrun_step_ratio` is the median over rounds of
  Ray / the mean of its two torchrun neighbours, and `control_ratio` the median of the second
  torchrun / the first (the noise floor). Step times on a shared VM drift by 20% between runs
  minutes apart, more than the difference measured, so each ratio compares neighbours in time (the
  pooled ratio is reported too);
- CPU: once a second, the CPU time of each process of the cluster and of the launcher; over the
  steady-state window, the cores used by the training workers and by everything else (Ray's daemons,
  the driver and Train's actors; in torchrun runs the torchrun agent and the idle cluster). It
  drifts far less than step times do;
- recovery: seconds from SIGKILL of one training worker (found through Ray's state API) to the first
  step after the restarted group resumed from its snapshot (and the same for torchrun, whose
  agent restarts the group, for comparison);
- node loss: an elastic run (`ray.num_workers=[1,2]`) loses a whole worker node (its raylet is
  SIGKILLed); seconds until the first step on the remaining worker.

    python -m bench.launchers            # writes bench/results/launchers.json
    python -m bench.launchers --smoke    # one short run per launcher, no faults
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Callable
from pathlib import Path

from bench.common import (
    REPO,
    first_step_after_restart,
    first_step_start,
    kept_memory_tier_keys,
    launch_cmd,
    overrides,
    records,
    result_path,
    train_records,
    wait_for,
)
from bench.machine import describe
from bench.scratch import scratch
from devtools.local_ray import LocalCluster, free_port, proc_stat


def step_times(recs: list[dict]) -> list[float]:
    """Seconds per step over each log interval of the first attempt, the first (warm-up) one left out.
    A record's `samples_per_s` counts only the time its steps ran, not snapshots or evals."""
    out, batch = [], None
    for r in recs:
        if r["kind"] == "start":
            if batch is not None:
                break
            batch = r["global_batch"]
        elif r["kind"] == "train":
            out.append(batch / r["samples_per_s"])
    return out[1:]


def cpu_per_step(recs: list[dict]) -> float | None:
    """CPU milliseconds per step of a training worker: over each log interval after the first (warm-up)
    of the first attempt, the mean over ranks of the process CPU time per step each rank measured
    itself (the `ranks` record's `cpu_ms`: every thread of the worker process, its snapshots
    included); the median over intervals."""
    per_interval, starts = [], 0
    for r in recs:
        starts += r["kind"] == "start"
        if starts > 1:
            break
        if r["kind"] == "ranks":
            per_interval.append(statistics.fmean(x["cpu_ms"] for x in r["ranks"]))
    return statistics.median(per_interval[1:]) if len(per_interval) > 1 else None


PHASES = [  # (phase, the mark that ends it), in launch order; a launcher's missing marks are skipped
    ("job submission", "driver_process"),
    ("driver start, ray.init", "driver_connected"),
    ("driver imports Ray Train (probes start)", "driver_imported"),
    ("preflight probes", "driver_checked"),
    ("worker processes started (Ray: controller, actors; after a failure: old group down)", "worker_process"),
    ("worker imports Ray Train, its context", "worker_setup"),
    ("worker imports torch, setup (network)", "worker_setup_done"),
    ("process group (Ray: training's imports meanwhile; torchrun: and imports)", "process_group"),
    ("data and model", "built"),
    ("snapshot load", "loaded"),
    ("first step", "first_step"),
]


def breakdown(start: dict, first_step: float, since: float,
              detected: float | None = None) -> dict[str, float]:
    """Seconds each start-up phase took, from `since` (the launch, or the kill) to the first step,
    from the marks in a `start` record (trainapp/observe/timeline.py); after a kill, `detected` (when Ray
    Train's controller saw the failure) splits detection off the restart. A phase whose mark came
    before the previous one (the driver's, in a restart) counts as 0 and is left out."""
    marks = {**start.get("startup", {}), "first_step": first_step, "detected": detected}
    out, last = {}, since
    for phase, name in [("detection", "detected"), *PHASES]:
        if marks.get(name) is not None and marks[name] > last:
            out[phase] = round(marks[name] - last, 2)
            last = marks[name]
    return out


def median_breakdown(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per phase, the median over runs (0 in a run without it). Medians of the parts need not add
    up to the median of the whole."""
    names = list(dict.fromkeys(p for r in runs for p in r))
    return {p: round(statistics.median(r.get(p, 0.0) for r in runs), 2) for p in names}


def steal_seconds() -> float:
    """CPU time the hypervisor gave to other guests (all cores), from /proc/stat; 0 where not reported."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class CpuSampler(threading.Thread):
    """Every `interval` seconds, the parent, the CPU seconds and the minor page faults so far of each
    process `pids()` names, and the CPU seconds of each thread of the training processes
    (`training(comm, ppid)`)."""

    def __init__(self, pids, training, interval: float = 1.0):
        super().__init__(daemon=True)
        self.pids, self.training, self.interval = pids, training, interval
        self.samples, self.done = [], threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self.done.wait(self.interval):
            now, threads = {}, {}
            for pid in self.pids():
                if st := proc_stat(pid):
                    comm, f = st
                    now[pid] = (comm, int(f[1]), self._cpu(f), int(f[7]))
                    if self.training(comm, int(f[1])):
                        threads[pid] = self._threads(pid)
            self.samples.append((time.time(), now, threads))

    def _cpu(self, fields: list[str]) -> float:
        return (int(fields[11]) + int(fields[12])) / self.tick

    def _threads(self, pid: int) -> dict[int, tuple[str, float]]:
        """{thread id: (name, CPU seconds)} of process `pid`. The seconds come from the thread's
        schedstat (nanoseconds): stat's clock ticks (10 ms) round each of Ray's small threads (its I/O,
        gRPC pollers, task events: under 1 ms a second each) to nothing over a window of seconds."""
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return {}
        out = {}
        for tid in tids:
            if st := proc_stat(pid, tid):
                try:
                    cpu = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
                except (OSError, ValueError, IndexError):  # a kernel without schedstat: ticks
                    cpu = self._cpu(st[1])
                out[tid] = (st[0], cpu)
        return out

    def _window(self, t0: float, t1: float):
        """The first and last samples between t0 and t1, and the seconds between them; None when fewer
        than two fall inside."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        return (inside[0], inside[-1], inside[-1][0] - inside[0][0]) if len(inside) > 1 else None

    def shares(self, t0: float, t1: float) -> tuple[float | None, float | None, float | None]:
        """Cores used by training processes and by the rest, and the training processes' minor page
        faults per second, between t0 and t1 (None when fewer than two samples fall inside)."""
        if (w := self._window(t0, t1)) is None:
            return None, None, None
        (_, a, _), (_, b, _), dt = w
        used, faults = [0.0, 0.0], 0
        for pid, (comm, ppid, cpu, minflt) in b.items():
            if pid in a:
                mine = self.training(comm, ppid)
                used[0 if mine else 1] += cpu - a[pid][2]
                faults += (minflt - a[pid][3]) if mine else 0
        return used[0] / dt, used[1] / dt, faults / dt

    def runtime_threads(self, t0: float, t1: float) -> tuple[float | None, float | None]:
        """Milliseconds of CPU per second, per training process, between t0 and t1, of the threads
        that are neither Python's (the training thread, trainapp's helpers: they carry the process's
        name) nor the process group's (gloo): under Ray, the core worker's main thread (its task loop)
        and its C++ threads (gRPC, I/O, task events); under torchrun, whatever the process started
        besides (nothing, with one intra-op thread). Also the main thread's share of it."""
        if (w := self._window(t0, t1)) is None:
            return None, None
        (_, _, a), (_, _, b), dt = w
        total = main = 0.0
        both = [pid for pid in b if pid in a]
        for pid in both:
            name = b[pid].get(pid, ("",))[0]
            for tid, (comm, cpu) in b[pid].items():
                used = cpu - a[pid].get(tid, (comm, 0.0))[1]
                ray_main = tid == pid and name.startswith("ray::")  # Ray runs training in another thread
                # Python's threads inherit the name of the thread that started them (Ray's: "ray::...").
                python = comm == name or comm.startswith("ray::")
                if ray_main or not (python or comm.startswith(("gloo", "pt_gloo"))):
                    total += used
                    main += used if ray_main else 0.0
        n = len(both) or 1
        return 1000 * total / dt / n, 1000 * main / dt / n


class Bench:
    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.cluster = LocalCluster(Path(f"/tmp/ta-bench-{uuid.uuid4().hex[:6]}"), workers=2, cpus=1,
                                    gcs_port=free_port(), dashboard_port=free_port(),
                                    head_nice=args.head_nice, worker_nice=args.worker_nice,
                                    health_check_period_ms=args.health_check_period_ms)
        self.procs: list[subprocess.Popen] = []

    def launch(self, launcher: str, run_dir: Path, *extra: str,
               workers: int = 2) -> tuple[subprocess.Popen, float]:
        cmd, env = launch_cmd(launcher, run_dir, overrides(self.args.steps, self.args.snapshot_every, *extra),
                              self.cluster, max_failures=2, workers=workers)
        t0 = time.time()
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        self.procs.append(p)
        return p, t0

    def finish(self, p: subprocess.Popen) -> None:
        if p.wait(timeout=900) != 0:
            raise RuntimeError(f"run failed: {p.args}")

    def plain_run(self, launcher: str, i: str, workers: int = 2, *extra: str) -> dict:
        """Startup seconds and its breakdown, steady step times, the CPU seconds stolen by other VMs
        meanwhile, the cores used by training and by everything else of the launcher and the cluster,
        and the training workers' CPU and minor page faults per step (each)."""
        run_dir = self.work / f"{launcher}-{i}-{workers}w"
        steal0 = steal_seconds()
        p, t0 = self.launch(launcher, run_dir, f"train.log_every={self.args.log_every}", *extra,
                            workers=workers)
        # Training: torchrun's children (its workers), or Ray's training actors.
        training = lambda comm, ppid: ppid == p.pid or comm.startswith("ray::RayTrainWo")  # noqa: E731
        # A smoke run's steady window lasts about a second on a fast CPU: sample it more often.
        sampler = CpuSampler(lambda: [p.pid, *_children(p.pid), *self.cluster.pids()], training,
                             interval=0.2 if self.args.smoke else 1.0)
        sampler.start()
        try:
            self.finish(p)
        finally:
            sampler.done.set()
            sampler.join()
        recs = records(run_dir)
        train = [r for r in recs if r["kind"] == "train"]
        cores, other, faults = sampler.shares(train[1]["time"], train[-1]["time"])
        runtime, main = sampler.runtime_threads(train[1]["time"], train[-1]["time"])
        steps = step_times(recs)
        step, first = statistics.median(steps), first_step_start(recs)
        return {"startup": first - t0, "steps": steps, "steal": steal_seconds() - steal0,
                "breakdown": breakdown(next(r for r in recs if r["kind"] == "start"), first, t0),
                "train_cores": cores, "other_cores": other, "train_cpu_ms_per_step": cpu_per_step(recs),
                "runtime_threads_ms_per_s": runtime, "runtime_main_thread_ms_per_s": main,
                "train_faults_per_step": None if faults is None else faults * step / workers}

    def kill_run(self, launcher: str, what: str, i: int = 0, node: str = "worker2", *extra: str,
                 kill_step: int | None = None, name: str | None = None,
                 ready: Callable[[], object] | None = None) -> tuple[float, dict[str, float]]:
        """Kill a worker (or the worker node `node`) at step `kill_step` (default args.kill_step) of a run
        with `extra` settings in WORK/`name`, and once `ready()` is true; seconds to the first step after
        resume, and where they went (detection: until Ray Train's controller recorded the failure)."""
        run_dir = self.work / (name or f"{launcher}-{what}-{i}")
        at = self.args.kill_step if kill_step is None else kill_step
        # A record every step: the first step after the restart is the moment measured.
        extra = ("train.log_every=1", *extra)
        if what == "node":
            extra += ("ray.num_workers=[1,2]", f"ray.worker_group_start_timeout_s={self.args.start_timeout}")
        p, _ = self.launch(launcher, run_dir, *extra)
        wait_for(lambda: any(r["step"] >= at for r in train_records(run_dir)), 600, "kill step")
        if ready is not None:
            wait_for(ready, 120, "ready to kill")
        if what == "node":
            victim = self.cluster.node_pids(node)["raylet"]
        elif launcher == "ray":
            victim = self.cluster.state("actors", class_name="RayTrainWorker", state="ALIVE")[-1]["pid"]
        else:
            victim = max(_children(p.pid))  # torchrun's children are its worker processes
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        self.finish(p)
        t_first = first_step_after_restart(run_dir)
        if t_first is None:
            raise RuntimeError(f"{run_dir}: no restart recorded")
        recs = records(run_dir)
        restart = [r for r in recs if r["kind"] == "start"][1]
        detected = next((r["time"] for r in recs if r["kind"] == "group_failure"), None)
        return t_first - t_kill, breakdown(restart, t_first, t_kill, detected)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        self.cluster.down()
        subprocess.run(["rm", "-rf", str(self.cluster.dir)], check=False)


def paired(values: list[float]) -> tuple[list[float], float]:
    """A round's torchrun, Ray run(s), torchrun values: each Ray run against the mean of the two
    torchrun runs around it in time, and the second torchrun against the first (the control)."""
    first, last = values[0], values[-1]
    return [v / ((first + last) / 2) for v in values[1:-1]], last / first


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _quiet_median(ratios: list[float], steal: list[float], limit: float = 1.0) -> float | None:
    quiet = [r for i, r in enumerate(ratios) if max(steal[3 * i:3 * i + 3]) < limit]
    return statistics.median(quiet) if quiet else None


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout.split()
    return [int(x) for x in out]


class Rounds:
    """Rounds of torchrun, Ray, torchrun runs of one size. Ray's run is compared with the mean of its
    two neighbours in time, which cancels drift that is linear over the round; the torchrun pair gives
    the noise floor of the same comparison."""

    def __init__(self, workers: int):
        self.workers = workers
        self.runs: dict[str, list[dict]] = {"torchrun": [], "ray": []}
        self.ratios: list[float] = []
        self.controls: list[float] = []
        self.cpu_ratios: list[float] = []
        self.cpu_controls: list[float] = []
        self.steal: list[float] = []

    def med(self, launcher: str, key: str) -> float | None:
        values = [r[key] for r in self.runs[launcher] if r[key] is not None]
        return statistics.median(values) if values else None

    def pooled(self, launcher: str) -> float:
        return statistics.median(t for r in self.runs[launcher] for t in r["steps"])

    def summary(self, suffix: str) -> dict:
        """The results, each key ending in `suffix` (the spare-core runs: "_spare_core")."""
        out = {
            "ray_vs_torchrun_step_ratio": statistics.median(self.ratios),
            "ray_vs_torchrun_step_ratio_per_round": [round(r, 3) for r in self.ratios],
            "control_torchrun_vs_torchrun_per_round": [round(r, 3) for r in self.controls],
            "control_ratio": statistics.median(self.controls),
            "ray_vs_torchrun_step_ratio_pooled": self.pooled("ray") / self.pooled("torchrun"),
            "step_ms_ray": 1000 * self.pooled("ray"),
            "step_ms_torchrun": 1000 * self.pooled("torchrun"),
            # Cores (1.0 = one core busy) over the steady-state window, medians over runs: the
            # training workers, and everything else the cluster and the launcher ran meanwhile (in
            # torchrun runs: the torchrun agent and the idle cluster).
            "train_cores_ray": self.med("ray", "train_cores"),
            "train_cores_torchrun": self.med("torchrun", "train_cores"),
            "other_cores_ray": self.med("ray", "other_cores"),
            "other_cores_torchrun": self.med("torchrun", "other_cores"),
            # CPU (as each worker measured it) and minor page faults of a training worker per step,
            # medians over runs; the CPU ratio is paired like the step ratio: Ray's run against the
            # mean of its two torchrun neighbours, median over rounds, with the torchrun pair's control.
            "train_cpu_ms_per_step_ray": self.med("ray", "train_cpu_ms_per_step"),
            "train_cpu_ms_per_step_torchrun": self.med("torchrun", "train_cpu_ms_per_step"),
            "train_cpu_ratio_ray_vs_torchrun": _median(self.cpu_ratios),
            "train_cpu_ratio_per_round": [round(r, 3) for r in self.cpu_ratios],
            "train_cpu_control_ratio": _median(self.cpu_controls),
            "train_cpu_control_per_round": [round(r, 3) for r in self.cpu_controls],
            # Of a Ray training worker's CPU: the threads of Ray's runtime (the core worker's main
            # thread, which runs its task loop and a signal check every 10 ms, and its gRPC and I/O
            # threads), in ms per second and per step; torchrun's workers have none.
            "runtime_threads_ms_per_s_ray": self.med("ray", "runtime_threads_ms_per_s"),
            "runtime_main_thread_ms_per_s_ray": self.med("ray", "runtime_main_thread_ms_per_s"),
            "runtime_threads_ms_per_s_torchrun": self.med("torchrun", "runtime_threads_ms_per_s"),
            "train_faults_per_step_ray": self.med("ray", "train_faults_per_step"),
            "train_faults_per_step_torchrun": self.med("torchrun", "train_faults_per_step"),
            # Time the hypervisor ran other guests on our cores, per run in launch order: a run that
            # lost seconds here is slower for reasons neither launcher controls.
            "steal_seconds_per_run": self.steal,
            # The same ratio over the rounds none of whose runs lost a second to steal.
            "ray_vs_torchrun_step_ratio_quiet_rounds": _quiet_median(self.ratios, self.steal),
        }
        cpu_ray, cpu_torchrun = out["train_cpu_ms_per_step_ray"], out["train_cpu_ms_per_step_torchrun"]
        if cpu_ray and cpu_torchrun:
            out["train_cpu_ratio_ray_vs_torchrun_unpaired"] = cpu_ray / cpu_torchrun
        runtime = out["runtime_threads_ms_per_s_ray"]
        if runtime is not None and out["step_ms_ray"]:
            out["runtime_threads_ms_per_step_ray"] = runtime * out["step_ms_ray"] / 1000
        for launcher in ("ray", "torchrun"):
            out[f"startup_seconds_{launcher}"] = self.med(launcher, "startup")
            out[f"startup_breakdown_{launcher}"] = median_breakdown(
                [r["breakdown"] for r in self.runs[launcher]])
        return {k + suffix: v for k, v in out.items()}


def rounds(b: Bench, n: int, workers: int) -> Rounds:
    r = Rounds(workers)
    for i in range(n):
        medians, cpu = [], []
        for j, launcher in enumerate(("torchrun", "ray", "torchrun")):
            run = b.plain_run(launcher, f"{i}{j}", workers)
            r.steal.append(round(run["steal"], 1))
            r.runs[launcher].append(run)
            medians.append(statistics.median(run["steps"]))
            cpu.append(run["train_cpu_ms_per_step"])
            print(f"{workers} worker(s), {launcher} run {i}.{j}: startup {run['startup']:.1f}s, median step "
                  f"{1000 * medians[-1]:.1f}ms, steal {run['steal']:.1f}s, cores: training "
                  f"{run['train_cores'] or 0:.2f}, rest {run['other_cores'] or 0:.2f}; per step and worker: "
                  f"{run['train_cpu_ms_per_step'] or 0:.1f} ms CPU, {run['train_faults_per_step'] or 0:.0f} "
                  f"page faults; launcher threads {run['runtime_threads_ms_per_s'] or 0:.1f} ms/s",
                  flush=True)
        (ratio,), control = paired(medians)
        r.ratios.append(ratio)
        r.controls.append(control)
        if all(cpu):
            (ratio,), control = paired(cpu)
            r.cpu_ratios.append(ratio)
            r.cpu_controls.append(control)
        print(f"{workers} worker(s), round {i}: step ray/torchrun {r.ratios[-1]:.3f}, "
              f"torchrun/torchrun {r.controls[-1]:.3f}; CPU per step "
              + (f"{r.cpu_ratios[-1]:.3f}, control {r.cpu_controls[-1]:.3f}" if all(cpu) else "not measured"),
              flush=True)
    return r


def fault_rounds(b: Bench, n: int) -> dict:
    """`n` rounds of: a Ray worker SIGKILLed, a torchrun worker SIGKILLed, a Ray worker node's raylet
    SIGKILLed (then a fresh node takes its place); medians, each run's seconds, median breakdowns."""
    faults = (("recovery_seconds", "ray", "worker"), ("recovery_seconds_torchrun", "torchrun", "worker"),
              ("node_loss_recovery_seconds", "ray", "node"))
    runs: dict[str, list[tuple[float, dict[str, float]]]] = {key: [] for key, _, _ in faults}
    node = "worker2"
    for i in range(n):
        for key, launcher, what in faults:
            seconds, parts = b.kill_run(launcher, what, i, node)
            runs[key].append((seconds, parts))
            print(f"{launcher} {what} lost (round {i}): training again in {seconds:.1f}s: {parts}",
                  flush=True)
            if what == "node":  # a fresh node in its place, for the next round and a whole cluster after
                node = f"worker2-r{i + 1}"
                b.cluster.join_worker(node, 3, cwd=REPO)
    out = {}
    for key, got in runs.items():
        out[key] = statistics.median(s for s, _ in got)
        out[key.replace("seconds", "seconds_per_run")] = [round(s, 2) for s, _ in got]
        out[key.replace("seconds", "breakdown")] = median_breakdown([p for _, p in got])
    return out


def parser() -> argparse.ArgumentParser:
    """The options, and the defaults of a Bench (bench/ray_floor.py builds its Bench from them)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one short run per launcher, no faults")
    p.add_argument("--rounds", type=int, default=6, help="rounds of torchrun, Ray, torchrun runs (2 workers)")
    p.add_argument("--spare-core-rounds", type=int, default=6,
                   help="the same with one training worker of one thread, the other core left to the daemons")
    p.add_argument("--no-faults", action="store_true", help="step times and startup only: no kills")
    p.add_argument("--kill-rounds", type=int, default=3, help="rounds of each fault (worker kill under each "
                   "launcher, node loss under Ray); medians reported")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--log-every", type=int, default=10,
                   help="train.log_every of the step-time runs (trainapp's default; 1 logs every step)")
    p.add_argument("--snapshot-every", type=int, default=10)
    p.add_argument("--kill-step", type=int, default=25)
    p.add_argument("--start-timeout", type=float, default=10.0,
                   help="ray.worker_group_start_timeout_s for the node-loss run (Ray's default: 60)")
    p.add_argument("--head-nice", type=int, default=LocalCluster.head_nice,
                   help="nice value of the head's processes")
    p.add_argument("--worker-nice", type=int, default=LocalCluster.worker_nice,
                   help="nice value of Ray's worker processes (Ray's default: 15)")
    p.add_argument("--health-check-period-ms", type=int, default=LocalCluster.health_check_period_ms,
                   help="how often the GCS checks each raylet (node-death detection)")
    p.add_argument("--out", help="result file (default bench/results/launchers.json)")
    return p


def main() -> int:
    args = parser().parse_args()
    if args.smoke:
        # 120 steps: a steady window of a few seconds, long enough for the Ray worker's main thread (about
        # 7 ms of CPU a second) to show in /proc's 10 ms ticks now that a run reports about once in 5 s.
        args.rounds, args.spare_core_rounds, args.steps = 1, 1, 120
    out = result_path("launchers.json", args.smoke, args.out)
    with scratch("ta-bench-") as tmp:
        b = Bench(args, Path(tmp))
        try:
            t = time.time()
            b.cluster.up(cwd=REPO)
            cluster_up = time.time() - t
            print(f"cluster up in {cluster_up:.1f}s", flush=True)
            result = {"cluster_up_seconds": cluster_up}
            if args.rounds:  # --rounds 0: the fault runs only
                two = rounds(b, args.rounds, workers=2)
                result.update(two.summary(""))
                if args.spare_core_rounds:
                    one = rounds(b, args.spare_core_rounds, workers=1)
                    result.update(one.summary("_spare_core"))
            if not (args.smoke or args.no_faults):
                result.update(fault_rounds(b, args.kill_rounds))
        finally:
            b.close()
    result.update({
        "targets": {"startup_seconds_ray": "<= 15", "recovery_seconds": "<= 8",
                    "node_loss_recovery_seconds": "<= 10", "train_cpu_ratio_ray_vs_torchrun": "<= 1.02",
                    "ray_vs_torchrun_step_ratio_spare_core": "<= 1.02"},
        "knobs": {"head_nice": args.head_nice, "worker_nice": args.worker_nice,
                  "health_check_period_ms": b.cluster.health_check_period_ms,
                  "health_check_failure_threshold": b.cluster.health_check_failure_threshold,
                  "ray.worker_group_start_timeout_s (node loss run)": args.start_timeout},
        "steps": args.steps, "log_every": args.log_every, "rounds": args.rounds,
        "kill_rounds": args.kill_rounds, "spare_core_rounds": args.spare_core_rounds, "smoke": args.smoke,
        "machine": describe(), "date": time.strftime("%Y-%m-%d"),
    })
    result.update(kept_memory_tier_keys(out))  # bench/memory.py's, measured apart
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()
                      if not isinstance(v, dict)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
