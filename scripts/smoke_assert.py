#!/usr/bin/env python3
"""The assertions of the container smoke tests: a run that lost a worker resumed and finished right.

One module for every backend: the kind smoke test (scripts/kind-smoke.sh, which deletes a Ray worker
pod) and the Docker-engine smoke test (which kills a container, and in a second run stops one with
`docker stop`). Only how the run directory is obtained differs; the checks read a local copy and are
the same for both:

    --backend kind    RUN_DIR is a path inside the Ray head pod (e.g. /mnt/runs/smoke); it is copied
                      out with `kubectl cp` into a temporary directory (or --dest) first.
    --backend docker  RUN_DIR is a path on this machine: the host side of the container's volume
                      (default); with --docker-container NAME, a path inside that container, copied
                      out with `docker cp` first (the Docker-engine smoke test does this).

A run directory is STORAGE/NAME of `python -m trainapp ray` (or run.dir of `trainapp train`): it holds
metrics.jsonl (one JSON record per line: kind start/train/eval/end) and the snapshots
step_XXXXXXXXX/ (Ray's layout, or snapshots/step_XXXXXXXXX/ under torchrun), each with a meta.json.

Checks, one line each, then a one-line summary; exit 0 when all pass, 1 otherwise:
    finished        an `end` record after the last `start`
    restarted       two or more `start` records, a later one with `resumed_step` set
    resumed-latest  each restart resumed from the newest snapshot that existed before the failure:
                    the highest multiple of snapshot.every_steps at or below the highest `train` step
                    recorded before that restart (with train.log_every=1; see expected_resume for
                    the two tolerances: steps after the last record, a snapshot being written); one
                    the memory tier resumed (`resumed_tier` memory or peer) from a step at least that
                    new and at most the last one reached
    redone          at most snapshot.every_steps steps were trained twice at each restart
    final-step      the newest snapshot's global_step equals the planned total steps
With --preempted SIGNAL (a worker was stopped, not killed: `docker stop`, a pod deleted), the two
checks of a kill are replaced by those of a preemption notice, which loses no step:
    preempted       a `preempted` record (trainapp's stop on a notice: the snapshot of the step
                    reached) with that signal, before the last `start`
    resumed-preempted  the first `start` after it resumed from exactly its step: zero steps redone
    non-root        (with --nonroot / --nonroot-selector) every process in each named container or
                    pod runs with a non-zero real and effective uid; read from /proc inside it by its
                    own python3 (`docker exec` / `kubectl exec`), so the image needs no ps

snapshot.every_steps comes from the first `start` record's config, the planned total from its
`total_steps` (or --expect-steps). Standard library only, so any python3 runs it.

    python scripts/smoke_assert.py RUN_DIR [--backend kind|docker] [--expect-steps N] [--nonroot NAME ...]
    python scripts/smoke_assert.py /mnt/runs/smoke --backend kind --context kind-trainapp \
        --nonroot-selector app.kubernetes.io/name=trainapp
    python scripts/smoke_assert.py /mnt/runs/smoke --docker-container ray-head --nonroot ray-head
    python scripts/smoke_assert.py /mnt/runs/smoke-stop --docker-container ray-head --preempted SIGTERM
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# trainapp.observe.metrics is standard-library only, and importing the package imports nothing else: the one
# reader of metrics.jsonl serves this script under any python3 too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainapp.observe import metrics  # noqa: E402

METRICS = metrics.METRICS
STEP_DIR = re.compile(r"^step_(\d{9})$")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


# ------------------------------------------------------------------------------------------------
# Reading a run directory


def snapshot_dirs(run_dir: Path) -> dict[int, Path]:
    """{step: directory} of the complete snapshots (with meta.json), Ray's or torchrun's layout."""
    found = {}
    for base in (Path(run_dir), Path(run_dir) / "snapshots"):
        if not base.is_dir():
            continue
        for d in base.iterdir():
            m = STEP_DIR.match(d.name)
            if m and d.is_dir() and (d / "meta.json").is_file():
                found[int(m.group(1))] = d
    return found


def newest_meta(run_dir: Path) -> dict | None:
    dirs = snapshot_dirs(run_dir)
    if not dirs:
        return None
    return json.loads((dirs[max(dirs)] / "meta.json").read_text())


def max_train_step(records: list[dict]) -> int:
    """Highest optimizer step of the `train` records (0 with none): the smoke scripts poll it."""
    return max((r["step"] for r in records if r.get("kind") == "train"), default=0)


def latest_restart(records: list[dict]) -> dict | None:
    """The newest `start` record if the run has restarted (None before): the smoke scripts poll it."""
    starts = [r for r in records if r.get("kind") == "start"]
    return starts[-1] if len(starts) > 1 else None


def latest_preempted(records: list[dict]) -> dict | None:
    """The newest `preempted` record (None before one): the smoke scripts poll it."""
    return next((r for r in reversed(records) if r.get("kind") == "preempted"), None)


# ------------------------------------------------------------------------------------------------
# The checks (backend-independent)


def _restarts(records: list[dict]) -> list[tuple[int, int | None, str]]:
    """For each start after the first: (highest train step recorded before it, its resumed_step, the tier
    it resumed from: storage, memory or peer)."""
    out = []
    for i, r in enumerate(records):
        if r.get("kind") == "start" and any(x.get("kind") == "start" for x in records[:i]):
            tier = r.get("resumed_tier") or "storage"
            out.append((max_train_step(records[:i]), r.get("resumed_step"), tier))
    return out


def resumed_well(before: int, resumed: int | None, tier: str, every: int, log_every: int = 1) -> bool:
    """Whether a restart resumed where it should: a storage snapshot `expected_resume` allows, or a memory
    copy at least as new as the oldest of those and at most the last step reached."""
    allowed = expected_resume(before, every, log_every)
    if tier in ("memory", "peer"):
        return isinstance(resumed, int) and min(allowed) <= resumed <= before + max(log_every, 1) - 1
    return (resumed or 0) in allowed


def expected_resume(before: int, every: int, log_every: int = 1) -> list[int]:
    """Snapshot steps a restart may have resumed from, given the highest `train` step recorded
    before it: the newest multiple of `every` at or below it. Two tolerances, both for what the
    records cannot show: steps run after the last record (up to log_every - 1 more, so a snapshot
    there may be newer), and a failure while the newest snapshot was being written (it is written
    right after its step's record), which leaves the one before it as the newest complete one."""
    lo = before // every * every
    if lo == before and lo >= every:
        lo -= every
    hi = before + max(log_every, 1) - 1
    return sorted(range(lo, hi // every * every + 1, every), reverse=True)


def check_preempted(records: list[dict], signal_name: str) -> list[Check]:
    """The checks of a run stopped by a preemption notice (instead of resumed-latest and redone): a
    `preempted` record with that signal before the last `start`, and the first `start` after it
    resumed from exactly its step (the notice's snapshot): no step trained twice."""
    signal_name = (signal_name.upper() if signal_name.upper().startswith("SIG")
                   else "SIG" + signal_name.upper())
    starts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
    notices = [i for i, r in enumerate(records) if r.get("kind") == "preempted" and starts and i < starts[-1]]
    if not notices:
        others = [r.get("signal") for r in records if r.get("kind") == "preempted"]
        why = (f"`preempted` record(s) {others} but no `start` after them" if others
               else "no `preempted` record (the notice never reached the training processes?)")
        return [Check("preempted", False, why), Check("resumed-preempted", False, "no preemption to check")]
    i = notices[-1]
    rec = records[i]
    step, sig = rec.get("step"), rec.get("signal")
    seconds = rec.get("seconds")
    ok = sig == signal_name and isinstance(step, int)
    checks = [Check("preempted", ok,
                    f"`preempted` record at step {step} ({sig}, snapshot {seconds} s after the signal, "
                    f"phase {rec.get('phase')})"
                    + ("" if sig == signal_name else f", expected {signal_name}"))]
    after = next(records[j] for j in starts if j > i)
    resumed = after.get("resumed_step")
    if resumed == step and isinstance(step, int):
        checks.append(Check("resumed-preempted", True,
                            f"preempted at step {step}, resumed {resumed}: 0 steps redone"))
    elif resumed is None:
        checks.append(Check("resumed-preempted", False, f"preempted at step {step}, but the next start "
                                                        "began from scratch (no resumed_step)"))
    else:
        redone = (step - resumed) if isinstance(step, int) and isinstance(resumed, int) else "?"
        checks.append(Check("resumed-preempted", False,
                            f"preempted at step {step} but resumed {resumed} "
                            f"({redone} step(s) redone, expected 0)"))
    return checks


def check_run(run_dir: Path, expect_steps: int | None = None, preempted: str | None = None) -> list[Check]:
    """Every check on a local run directory, in order. `preempted`: the signal of the notice the run
    got (e.g. SIGTERM): its checks replace resumed-latest and redone (see check_preempted)."""
    run_dir = Path(run_dir)
    try:
        records = metrics.read(run_dir)
    except OSError as e:
        return [Check("metrics", False, f"cannot read {run_dir / METRICS} ({e.__class__.__name__}: {e})")]
    starts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
    if not starts:
        return [Check("metrics", False,
                      f"{run_dir / METRICS} has no `start` record ({len(records)} records)")]
    first = records[starts[0]]
    cfg = first.get("config") or {}
    every = int((cfg.get("snapshot") or {}).get("every_steps") or 0)
    log_every = int((cfg.get("train") or {}).get("log_every") or 1)
    checks = []

    ends = [i for i, r in enumerate(records) if r.get("kind") == "end"]
    finished = bool(ends) and ends[-1] > starts[-1]
    checks.append(Check("finished", finished,
                        f"`end` record at steps={records[ends[-1]].get('steps')}" if finished
                        else f"no `end` record after the last of {len(starts)} `start` records"))

    restarts = _restarts(records)
    resumed = [(b, s) for b, s, _ in restarts if s is not None]
    checks.append(Check("restarted", bool(resumed),
                        f"{len(starts)} `start` records, resumed at step(s) {[s for _, s in resumed]}"
                        if resumed else f"{len(starts)} `start` record(s) and none resumed from a snapshot"))

    if preempted:
        checks += check_preempted(records, preempted)
    elif not restarts:
        checks.append(Check("resumed-latest", False, "no restart to check"))
        checks.append(Check("redone", False, "no restart to check"))
    elif every <= 0:
        checks.append(Check("resumed-latest", False, f"snapshot.every_steps={every}: no periodic snapshots"))
        checks.append(Check("redone", False, f"snapshot.every_steps={every}: no periodic snapshots"))
    else:
        bad = [(b, s, t) for b, s, t in restarts if not resumed_well(b, s, t, every, log_every)]
        def tier(t: str) -> str:
            return f" from {t}" if t != "storage" else ""

        pairs = ", ".join(f"trained to {b}, resumed {s}{tier(t)}" for b, s, t in restarts)
        checks.append(Check("resumed-latest", not bad,
                            f"{pairs} (snapshot every {every})" if not bad else
                            "; ".join(f"trained to {b} but resumed {s}{tier(t)}, expected "
                                      f"{' or '.join(map(str, expected_resume(b, every, log_every)))}"
                                      f"{' or newer' if t != 'storage' else ''}" for b, s, t in bad)))
        redone = [b - (s or 0) for b, s, _ in restarts]
        checks.append(Check("redone", max(redone) <= every,
                            f"{max(redone)} step(s) redone at most (limit {every}: snapshot.every_steps)"))

    planned = expect_steps if expect_steps is not None else first.get("total_steps")
    if planned is None:
        planned = (cfg.get("train") or {}).get("max_steps")
    meta = newest_meta(run_dir)
    if meta is None:
        checks.append(Check("final-step", False, f"no snapshot step_*/meta.json in {run_dir}"))
    else:
        step = meta.get("global_step")
        checks.append(Check("final-step", planned is not None and step == planned,
                            f"newest snapshot at global_step={step}, planned {planned}"))
    return checks


def report(checks: list[Check], run_dir: Path | str, out=None) -> bool:
    out = out or sys.stdout  # looked up at call time (pytest's capsys replaces sys.stdout)
    for c in checks:
        print(c.line(), file=out)
    failed = [c.name for c in checks if not c.ok]
    if failed:
        print(f"smoke_assert: FAIL {len(failed)} of {len(checks)} checks ({', '.join(failed)}) in {run_dir}",
              file=out)
    else:
        print(f"smoke_assert: PASS {len(checks)} of {len(checks)} checks in {run_dir}", file=out)
    return not failed


# ------------------------------------------------------------------------------------------------
# Backends: where the run directory comes from


def fetch_kind(remote_dir: str, dest: Path, namespace: str = "trainapp", context: str | None = None,
               pod: str | None = None, selector: str = "app.kubernetes.io/component=ray-head",
               container: str | None = None) -> Path:
    """Copy RUN_DIR out of the Ray head pod with `kubectl cp` (needs tar in the image); returns the copy."""
    kubectl = ["kubectl", *(["--context", context] if context else []), "-n", namespace]
    if pod is None:
        pod = subprocess.run([*kubectl, "get", "pod", "-l", selector, "--field-selector=status.phase=Running",
                              "-o", "jsonpath={.items[0].metadata.name}"],
                             check=True, capture_output=True, text=True).stdout.strip()
        if not pod:
            raise RuntimeError(f"no running pod with labels {selector} in namespace {namespace}")
    local = Path(dest) / Path(remote_dir.rstrip("/")).name
    subprocess.run([*kubectl, "cp", *(["-c", container] if container else []), f"{pod}:{remote_dir}",
                    str(local)], check=True)
    return local



def fetch_docker(container: str, remote_dir: str, dest: Path, docker: str | None = None) -> Path:
    """Copy RUN_DIR out of a container with `docker cp` (running or stopped; volumes included)."""
    local = Path(dest) / Path(remote_dir.rstrip("/")).name
    subprocess.run([docker or os.environ.get("DOCKER", "docker"), "cp", f"{container}:{remote_dir}",
                    str(local)], check=True, capture_output=True, text=True, timeout=300)
    return local


# ------------------------------------------------------------------------------------------------
# Non-root: every process of a container or pod, read from /proc inside it (both backends)

# Run by the container's own python3: the images have no ps. One JSON list of the processes the
# container sees (its PID namespace), with real and effective uid; this lister itself is one of them,
# so it also shows the user that `docker exec` / `kubectl exec` get by default: the image's.
PROCESS_LISTER = r"""
import json, os
procs = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/status") as f:
            uid, euid = next(line.split()[1:3] for line in f if line.startswith("Uid:"))
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, StopIteration):
        continue
    procs.append({"pid": int(pid), "uid": int(uid), "euid": int(euid), "cmd": cmd[:120]})
print(json.dumps(procs))
"""


def docker_exec(container: str, docker: str | None = None) -> list[str]:
    return [docker or os.environ.get("DOCKER", "docker"), "exec", container]


def kind_exec(pod: str, namespace: str = "trainapp", context: str | None = None) -> list[str]:
    return ["kubectl", *(["--context", context] if context else []), "-n", namespace, "exec", pod, "--"]


def kind_pods(selector: str, namespace: str = "trainapp", context: str | None = None) -> list[str]:
    """Names of the running pods with these labels."""
    out = subprocess.run(["kubectl", *(["--context", context] if context else []), "-n", namespace, "get",
                          "pod", "-l", selector, "--field-selector=status.phase=Running",
                          "-o", "jsonpath={.items[*].metadata.name}"],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return out.split()


def list_processes(exec_prefix: list[str]) -> list[dict]:
    """[{pid, uid, euid, cmd}] of one container; exec_prefix runs a command in it (docker_exec, kind_exec)."""
    out = subprocess.run([*exec_prefix, "python3", "-I", "-c", PROCESS_LISTER],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)


def collect_processes(targets: dict[str, list[str]]) -> dict[str, list[dict] | str]:
    """{name: processes} for {name: exec_prefix}; a name whose listing failed maps to the error (a str)."""
    found: dict[str, list[dict] | str] = {}
    for name, prefix in targets.items():
        try:
            found[name] = list_processes(prefix)
        except subprocess.CalledProcessError as e:
            last = (e.stderr or "").strip().splitlines()
            found[name] = f"exit {e.returncode}" + (f": {last[-1]}" if last else "")
        except (OSError, subprocess.TimeoutExpired, ValueError) as e:
            found[name] = f"{e.__class__.__name__}: {e}"
    return found


def check_nonroot(listings: dict[str, list[dict] | str]) -> Check:
    """PASS when every listed process has a non-zero real and effective uid, in every container."""
    if not listings:
        return Check("non-root", False, "no container or pod to check")
    problems, uids, count = [], set(), 0
    for name, procs in listings.items():
        if isinstance(procs, str):
            problems.append(f"{name}: cannot list processes ({procs})")
            continue
        if not procs:
            problems.append(f"{name}: no processes listed")
            continue
        count += len(procs)
        uids.update(p["uid"] for p in procs)
        uids.update(p["euid"] for p in procs)
        root = [p for p in procs if p["uid"] == 0 or p["euid"] == 0]
        if root:
            problems.append(f"{name}: {len(root)} process(es) as root, e.g. pid {root[0]['pid']} "
                            f"{root[0]['cmd']!r}")
    if problems:
        return Check("non-root", False, "; ".join(problems))
    return Check("non-root", True, f"{count} processes in {len(listings)} containers "
                                   f"({', '.join(listings)}), uid(s) {sorted(uids)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="smoke_assert.py", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's storage directory (STORAGE/NAME)")
    p.add_argument("--backend", choices=("kind", "docker"), default="docker",
                   help="kind: RUN_DIR is in the Ray head pod, copied out with kubectl cp; "
                        "docker (default): RUN_DIR is a path on this machine")
    p.add_argument("--expect-steps", type=int, help="planned total steps (default: the first start record's)")
    p.add_argument("--preempted", metavar="SIGNAL",
                   help="the run got a preemption notice (e.g. SIGTERM from `docker stop`), not a kill: "
                        "check its `preempted` record and a resume from exactly that step instead of "
                        "resumed-latest and redone")
    p.add_argument("--progress", action="store_true",
                   help="for polling: read metrics.jsonl lines from stdin (RUN_DIR: -) and print "
                        "`MAX_TRAIN_STEP RESUMED_STEP` (`-` until the run has resumed from a snapshot)")
    k = p.add_argument_group("kind backend")
    k.add_argument("--context", help="kubectl context (default: the current one)")
    k.add_argument("--namespace", default="trainapp")
    k.add_argument("--pod", help="pod to copy from (default: the running pod matching --selector)")
    k.add_argument("--selector", default="app.kubernetes.io/component=ray-head")
    k.add_argument("--container", help="container of the pod (default: kubectl's choice)")
    k.add_argument("--dest", type=Path, help="where to put the copy, kind or --docker-container "
                                             "(default: a new temporary directory)")
    d = p.add_argument_group("docker backend")
    d.add_argument("--docker-container", metavar="NAME",
                   help="RUN_DIR is a path inside this container (e.g. on its volume), copied out with "
                        "docker cp (default: RUN_DIR is a local path); the CLI is $DOCKER, else docker")
    n = p.add_argument_group("non-root check (either backend; skipped when neither option is given)")
    n.add_argument("--nonroot", metavar="NAME", action="append", default=[],
                   help="container (docker) or pod (kind) whose processes must all run as a non-root uid; "
                        "repeatable")
    n.add_argument("--nonroot-selector", metavar="LABELS",
                   help="kind: also every running pod with these labels, e.g. "
                        "app.kubernetes.io/name=trainapp")
    args = p.parse_args(argv)
    if args.progress:
        records = metrics.parse(sys.stdin)
        restart = latest_restart(records) or {}
        resumed = restart.get("resumed_step")
        print(max_train_step(records), "-" if resumed is None else resumed)
        return 0
    if args.nonroot_selector and args.backend != "kind":
        p.error("--nonroot-selector needs --backend kind (name the containers with --nonroot)")
    if args.docker_container and args.backend != "docker":
        p.error("--docker-container needs --backend docker")

    run_dir: Path | str = args.run_dir
    if args.backend == "kind":
        dest = args.dest or Path(tempfile.mkdtemp(prefix="smoke-assert-"))
        dest.mkdir(parents=True, exist_ok=True)
        try:
            local = fetch_kind(args.run_dir, dest, args.namespace, args.context, args.pod, args.selector,
                               args.container)
        except (subprocess.CalledProcessError, RuntimeError, OSError) as e:
            print(f"FAIL fetch: cannot copy {args.run_dir} out of the Ray head pod ({e})")
            print(f"smoke_assert: FAIL 1 of 1 checks (fetch) in {args.run_dir}")
            return 1
        print(f"smoke_assert: copied {args.run_dir} from the head pod to {local}")
        run_dir = local
    elif args.docker_container:
        dest = args.dest or Path(tempfile.mkdtemp(prefix="smoke-assert-"))
        dest.mkdir(parents=True, exist_ok=True)
        try:
            local = fetch_docker(args.docker_container, args.run_dir, dest)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            why = (getattr(e, "stderr", None) or str(e)).strip().splitlines()[-1:] or [""]
            print(f"FAIL fetch: cannot copy {args.run_dir} out of container {args.docker_container} "
                  f"({why[0]})")
            print(f"smoke_assert: FAIL 1 of 1 checks (fetch) in {args.run_dir}")
            return 1
        print(f"smoke_assert: copied {args.run_dir} from container {args.docker_container} to {local}")
        run_dir = local

    checks = check_run(Path(run_dir), args.expect_steps, args.preempted)
    if args.nonroot or args.nonroot_selector:
        if args.backend == "kind":
            pods = list(args.nonroot)
            if args.nonroot_selector:
                try:
                    pods += [x for x in kind_pods(args.nonroot_selector, args.namespace, args.context)
                             if x not in pods]
                except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
                    checks.append(Check("non-root", False, f"cannot list pods {args.nonroot_selector} ({e})"))
                    return 0 if report(checks, run_dir) else 1
            targets = {x: kind_exec(x, args.namespace, args.context) for x in pods}
        else:
            targets = {x: docker_exec(x) for x in args.nonroot}
        checks.append(check_nonroot(collect_processes(targets)))
    return 0 if report(checks, run_dir) else 1


if __name__ == "__main__":
    sys.exit(main())
