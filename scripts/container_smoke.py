#!/usr/bin/env python3
"""Smoke test on a real Docker engine (CPU only): the kind overlay's pods started from the rendered
manifests as a kubelet would, and two training jobs submitted as the RayJob's entrypoint: one survives a
worker pod killed, the other a worker pod deleted (preStop, SIGTERM) without redoing a step.

    manifests `make k8s-render-kind` (the overlay a user applies to kind), the Secret `make k8s-token`
             makes, and k8s/kuberay/rayjob.train.yaml's entrypoint and runtime env; every field of every
             Deployment's pod template must be one the runner implements (scripts/dockerlet/podspec.py),
             else one line names the manifest, the object and the field; then, with the image, what a
             schema cannot see (scripts/dockerlet/preflight.py): modules, Service names, config paths
    engine   a private dockerd: its own socket, data root and exec root in a temporary directory; no
             docker0, no iptables rules, no ip_forward change (containers reach nothing outside their
             network; only the build uses the host's network)
    base     a Debian bookworm base made with debootstrap (python3, python3-venv, ca-certificates,
             iproute2, this machine's CA bundle) and `docker import`: no registry needed
    image    the CPU image from docker/Dockerfile (target cpu), pip reading this machine's local
             package folders (`pip config list`) served read-only on 127.0.0.1 for the build
    task     a user's task added the documented way (examples/tabular/Dockerfile: FROM the image, the
             task's package copied in, on PYTHONPATH) and trained 20 steps in a container with a read-only
             root, no capabilities, the image's user and no network
    pods     Deployment/ray-head (k8s/deployment.ray-head.yaml) and Deployment/ray-cpu-workers
             (k8s/deployment.ray-gpu-workers.yaml as the overlay patches it), each pod one container made
             from its template by scripts/dockerlet: command/args, env (valueFrom, envFrom), volumes (the
             ConfigMap as files, emptyDirs as tmpfs of their sizeLimit, the claim as one shared Docker
             volume), securityContext (user, groups, fsGroup, read-only root, capabilities, no new
             privileges, seccomp), resources.limits, the Service's names resolving to the head pod, the
             probes on their periods (a pod counts as ready when its readiness probe passes); one line per
             pod says its Deployment, the file under k8s/ it comes from and when it was ready. The head's
             Deployment goes first. No NCCL/Gloo interface pinned: network.interface=auto must pick eth0
             in every worker pod
    kill     `ray job submit` (to the head pod's IP, as a port-forward would give) of the RayJob's
             entrypoint plus the smoke's sizes (2 workers, 40 steps, a snapshot every 10) -> the pod of
             rank 0 deleted with --grace-period=0 --force (SIGKILL, no preStop) at step >= 25 -> the
             Deployment replaces it -> the job resumes from its newest snapshot (20) and succeeds
    stop     a second run (60 steps) -> rank 0's pod deleted as `kubectl delete pod` does: preStop
             (`trainapp drain`), then SIGTERM, SIGKILL only after terminationGracePeriodSeconds -> all ranks
             stop after the next step with a snapshot of it and a `preempted` record, the container exits
             by itself (143), and the job resumes from exactly that step: zero steps redone
    checks   scripts/smoke_assert.py on each run directory (copied out with docker cp): finished,
             restarted, final step, every process in the pods non-root, and for the kill run a resume
             from the newest snapshot with at most snapshot.every_steps redone, for the stop run
             (--preempted SIGTERM) a `preempted` record and a resume from exactly its step
    mutation the worker Deployment changed in a copy (its command's module renamed) fails in one line
             naming the Deployment: in the preflight, and at run time (its pod's container exits); a copy
             whose liveness probe fails is restarted
    kuberay  those pods removed, the RayCluster of k8s/overlays/kind-cpu-kuberay started, its pods as the
             KubeRay operator v1.7.0 builds them (scripts/dockerlet/kuberay.py: the generated `ray start`,
             env, labels, the workers' wait-gcs-ready init container, the head Service), and a 20-step run
             of the RayJob's entrypoint on them
    teardown containers, network, volumes, the dockerd (by PID) and the temporary directory, also
             on failure or Ctrl-C

What Kubernetes does that this cannot (scripts/dockerlet/__init__.py): scheduling (one host), NetworkPolicy
enforcement, the device plugin (no GPUs), ClusterIPs (a Service's name resolves to its pods' IPs), Service
environment variables, emptyDirs that outlive a container restart, the KubeRay operator itself (its pods
are built from a reading of its code) and the RayJob's submitter pod and autoscaler sidecar.

Usage: scripts/container_smoke.py   (or `make container-smoke`); as root (it starts dockerd).
Environment:
  SMOKE_DOCKER_HOST=unix:///PATH  use this running engine instead of starting one: it is never stopped,
                                  only this run's containers, network and volume are removed
  KEEP_DOCKER_ROOT=DIR            the private dockerd keeps its data root (base, image, build cache) in
                                  DIR between runs, so a rebuild takes seconds: local iteration only, never CI
  SMOKE_TMPDIR=/var/tmp           where the temporary directory goes (the data root needs ~7 GB)
  SKIP_BUILD=1                    use the engine's IMAGE as it is
  IMAGE=trainapp:0.1.0-cpu        tag of the image built and run
  CPU_BASE=IMAGE                  base of the build (default: python:3.11-slim-bookworm if the engine has
                                  it, else the debootstrap base); an image the engine lacks is pulled
  DEBIAN_MIRROR=URL               debootstrap's mirror (default http://deb.debian.org/debian)
  SMOKE_BUILD_ARGS="..."          more `docker build` arguments, last: "--build-arg PIP_NO_INDEX=1"
  RAY=PATH                        Ray CLI for `ray job` (default .venv/bin/ray, else ray on PATH)
  DOCKER=docker                   docker CLI for everything but the build (see build_command)
  TIMEOUT=900                     seconds for each job, from submission to SUCCEEDED
  SMOKE_RENDERED_FILE=PATH        start the pods of this rendered YAML instead of `make k8s-render-kind`
Needs: Linux, root, the docker CLI, dockerd + containerd + debootstrap
(`apt-get install -y docker.io debootstrap`), the Ray CLI (`make venv`), ~7 GB free disk.
Exit status: 0 passed, 1 failed, 2 a prerequisite is missing or a setting is wrong, 130 interrupted.

Package sources of the build: pip's configuration on this machine. Every local index (file://.../simple)
and find-links folder is served on 127.0.0.1 by `python3 -m http.server` for the build only and
passed as PIP_INDEX_URL / PIP_EXTRA_INDEX_URL / PIP_FIND_LINKS build arguments, local ones before the
public index, so pip takes a wheel from local disk whenever it has the same file (ties go to the
first source); TORCH_INDEX_URL is then empty (torch from those indexes). Nothing machine-specific
goes into the Dockerfile: these are build arguments of this run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(REPO)]
import smoke_assert  # noqa: E402  (the shared assertions, beside this script)

import yaml  # noqa: E402
from dockerlet import kuberay, preflight  # noqa: E402  (pods from the rendered manifests, beside this script)
from dockerlet.manifests import ManifestError, Objects, namespace_of, ref  # noqa: E402
from dockerlet.podspec import check_fields, dns_names, selects  # noqa: E402
from dockerlet.runtime import PodFailure, Runtime  # noqa: E402

from trainapp.observe import metrics  # noqa: E402  (standard library only: the one metrics.jsonl reader)

PROG = "container-smoke"
LOCAL_BASE = "trainapp-smoke-base:bookworm"
PYTHON_BASE = "python:3.11-slim-bookworm"  # the Dockerfile's CPU_BASE default
DEBOOTSTRAP_INCLUDE = "python3,python3-venv,python3-pip,ca-certificates,iproute2"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PYPI = "https://pypi.org/simple"
MIN_FREE_GB = 12
PKG_PORT = 28180  # the local package server's port when free (else any)

# The run: as scripts/kind-smoke.sh, plus 96-pixel images so that a step takes 0.6 s or more here (at 32
# pixels the steps are over in seconds, before a poll can see step 20). The kill comes between two
# snapshots (20 and 30), so that steps are redone and a resume from anything but step 20 would show;
# the 15 steps after it pass a snapshot (30) and end at one (40).
STEPS, EVERY, KILL_AT = 40, 10, 25
# The stop run: stopped at step >= 25 too, but the notice takes longer to land than a kill (preStop ->
# `trainapp drain` -> SIGTERM to the training processes -> the next step), and the run must still be
# going then (the notice's step was 3 after STOP_AT in the runs seen: 35 steps leave room for more).
STOP_STEPS, STOP_AT = 60, 25
KUBERAY_STEPS = 20  # a short run on the RayCluster's pods: they start and train
RUNS = "/mnt/runs"  # the run claim's mountPath in every Ray pod (the entrypoint's ray.storage_path)
RAYJOB = REPO / "k8s/kuberay/rayjob.train.yaml"  # the job's entrypoint and runtime env


def train_args(steps: int, name: str) -> list[str]:
    """The smoke's overrides, after the RayJob's entrypoint (the later value of a key wins)."""
    return [
        f"ray.name={name}", "ray.num_workers=2", "ray.max_failures=3",
        # Time for the replacement pod's node to join (~10 s) before Ray Train gives up on a group of 2.
        "ray.worker_group_start_timeout_s=120",
        f"train.max_steps={steps}", "train.epochs=20", "train.log_every=1", f"snapshot.every_steps={EVERY}",
        "data.train_size=2048", "data.val_size=256", "data.image_size=96", "model.name=smallcnn",
        "train.progress=false",
    ]


T0 = time.monotonic()


class Failure(Exception):
    """The smoke test failed: exit 1."""


class Usage(Exception):
    """A prerequisite is missing or a setting is wrong: exit 2."""


class Interrupted(Exception):
    """SIGINT or SIGTERM: exit 130."""


def log(msg: str) -> None:
    print(f"{PROG} [{int(time.monotonic() - T0):4d}s] {msg}", flush=True)


def tail(text: str, n: int, prefix: str) -> None:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # Ray's colours
    for line in text.rstrip().splitlines()[-n:]:
        print(f"  {prefix}{line}", flush=True)


def run(cmd: list[str], *, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run a command, capture its output; on failure raise Failure naming the command and its last line."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        raise Failure(f"`{shlex.join(cmd)[:120]}` did not finish within {timeout:.0f}s") from None
    if check and r.returncode != 0:
        last = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Failure(f"`{shlex.join(cmd)[:120]}` failed (exit {r.returncode}): {last[0]}")
    return r


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below path (deepest first): debootstrap's /proc, a dead dockerd's overlays."""
    root = os.path.realpath(path)
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            mp = line.split()[1].replace("\\040", " ")
            if mp == root or mp.startswith(root + "/"):
                found.append(mp)
    return sorted(found, key=len, reverse=True)


def remove_tree(path: Path) -> None:
    """rm -rf that first unmounts what is mounted below and never crosses into another file system."""
    if not path.exists():
        return
    for mp in mounts_under(path):
        subprocess.run(["umount", "-l", mp], capture_output=True)
    left = mounts_under(path)
    if left:
        print(f"{PROG}: not removing {path}: still mounted below it: {', '.join(left[:3])}", flush=True)
        return
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], capture_output=True)


class Smoke:
    def __init__(self, env: dict[str, str]):
        self.env = env
        self.pip_env = {k: env[k] for k in ("HOME",) if k in env}
        self.docker = env.get("DOCKER", "docker")
        self.image = env.get("IMAGE", "trainapp:0.1.0-cpu")
        self.skip_build = env.get("SKIP_BUILD", "0") == "1"
        self.cpu_base = env.get("CPU_BASE", "")
        self.mirror = env.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
        self.extra_build_args = shlex.split(env.get("SMOKE_BUILD_ARGS", ""))
        self.engine_host = env.get("SMOKE_DOCKER_HOST", "")
        self.keep_root = Path(env["KEEP_DOCKER_ROOT"]).resolve() if env.get("KEEP_DOCKER_ROOT") else None
        self.tmp_parent = Path(env.get("SMOKE_TMPDIR", "/var/tmp"))
        raw_timeout = env.get("TIMEOUT", "900")
        if not raw_timeout.isdigit() or int(raw_timeout) <= 0:
            raise Usage(f"TIMEOUT={raw_timeout!r}: must be a positive number of seconds")
        self.timeout = int(raw_timeout)
        ray = env.get("RAY") or (str(REPO / ".venv/bin/ray") if (REPO / ".venv/bin/ray").exists() else "ray")
        self.ray = shutil.which(ray) or ""
        if not self.ray:
            raise Usage(f"Ray CLI {ray} not found: run `make venv` (Ray 2.60.0), or set RAY=path/to/ray")

        self.id = secrets.token_hex(3)
        self.label = f"trainapp.smoke={self.id}"
        self.head = ""  # the Ray head pod's name (its container's too)
        self.name = time.strftime("smoke-%Y%m%d-%H%M%S")
        self.stop_name = f"{self.name}-stop"
        self.job = self.name  # the job being run (status, records, diagnostics)
        self.last_status = 0.0
        self.summaries: list[str] = []

        self.tmp: Path | None = None
        self.dockerd: subprocess.Popen | None = None
        self.exec_root: Path | None = None
        self.engine_up = False
        self.build: subprocess.Popen | None = None
        self.debootstrap: subprocess.Popen | None = None
        self.task_image: str | None = None
        self.servers: list[subprocess.Popen] = []
        self.submitted = False
        self.port_host = ""  # the head pod's IP: the job API is on its port 8265
        self.image_answers: dict[str, bool] = {}
        self.k8s: Runtime | None = None
        self.objects: Objects | None = None
        self.stage = "checking prerequisites"
        self.build_cmd: list[str] = []
        self.build_env: dict[str, str] = {}
        self.timings: dict[str, float] = {}
        self.detail = ""

    # ------------------------------------------------------------------------------------ helpers

    @contextlib.contextmanager
    def timed(self, stage: str):
        self.stage, start = stage, time.monotonic()
        try:
            yield
        finally:
            self.timings[stage] = self.timings.get(stage, 0) + time.monotonic() - start

    def d(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return run([self.docker, *args], check=check, timeout=timeout)

    def image_exists(self, ref: str) -> bool:
        return self.d("image", "inspect", ref, check=False).returncode == 0

    def jobs_api(self, path: str = "") -> dict | list:
        """GET the head's job REST API (/api/jobs/...) with the token: a poll costs milliseconds, where
        `ray job status` takes seconds and prints no status word for a finished job."""
        req = urllib.request.Request(f"http://{self.port_host}:8265/api/jobs/{path}",
                                     headers={"Authorization": f"Bearer {os.environ['RAY_AUTH_TOKEN']}"})
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as r:
            return json.load(r)

    def job_status(self) -> str:
        try:
            return self.jobs_api(self.job).get("status", "")
        except (OSError, ValueError):  # URLError is an OSError; the head may be busy: ask again later
            return ""

    def check_job_alive(self) -> None:
        status = self.job_status()
        if status in ("FAILED", "STOPPED"):
            raise Failure(f"job {self.job} is {status} (its log is below)")

    def records(self) -> list[dict]:
        """The run's metrics.jsonl, read in the head container (empty while it does not exist)."""
        r = self.d("exec", self.head, "cat", f"{RUNS}/{self.job}/metrics.jsonl", check=False, timeout=30)
        return metrics.parse(r.stdout.splitlines()) if r.returncode == 0 else []

    # ----------------------------------------------------------------------------- prerequisites

    def preflight(self) -> None:
        if not sys.platform.startswith("linux"):
            raise Usage("needs Linux (dockerd, debootstrap)")
        if not shutil.which(self.docker):
            raise Usage(f"docker CLI {self.docker!r} not found: apt-get install -y docker.io, "
                        f"or set DOCKER=path")
        if not (REPO / "docker/Dockerfile").is_file():
            raise Usage(f"{REPO}/docker/Dockerfile not found: run from a trainapp checkout")
        if not self.engine_host:
            if os.geteuid() != 0:
                raise Usage("starting dockerd needs root: run as root, "
                            "or set SMOKE_DOCKER_HOST to a running engine")
            for tool in ("dockerd", "containerd"):
                if not shutil.which(tool):
                    raise Usage(f"{tool} not found: apt-get install -y docker.io "
                                "(or set SMOKE_DOCKER_HOST to a running engine)")
            if (self.keep_root is None and not self.skip_build and not self.cpu_base
                    and not shutil.which("debootstrap")):
                raise Usage("debootstrap not found (it makes the base image, no registry is asked): "
                            "apt-get install -y debootstrap, or set CPU_BASE to an image")
            self.tmp_parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.tmp_parent).free / 2**30
            if self.keep_root is None and free < MIN_FREE_GB:
                raise Usage(f"SMOKE_TMPDIR={self.tmp_parent}: {free:.1f} GB free, the engine's data root "
                            f"needs {MIN_FREE_GB} GB; point SMOKE_TMPDIR at a larger disk")
        if not self.env.get("SMOKE_RENDERED_FILE") and not shutil.which("kubectl"):
            raise Usage("kubectl not found: `make k8s-render-kind` renders the kind overlay with it "
                        "(or set SMOKE_RENDERED_FILE to a rendered YAML)")
        if not self.skip_build:
            self.build_cmd = self.build_command()

    def build_command(self) -> list[str]:
        """`docker build` with BuildKit: the legacy builder would build every stage before `cpu`,
        the gpu one (a CUDA base from a registry) included. Docker >= 23 clients need the buildx plugin
        for BuildKit; older clients (docker.io's /usr/bin/docker, 20.10) have it built in."""
        if run([self.docker, "buildx", "version"], check=False).returncode == 0:
            return [self.docker, "buildx", "build", "--load"]
        for client in dict.fromkeys([self.docker, "/usr/bin/docker"]):
            if not shutil.which(client):
                continue
            r = run([client, "version", "--format", "{{.Client.Version}}"], check=False)
            m = re.match(r"(\d+)\.", r.stdout.strip())
            if m and int(m.group(1)) < 23:
                self.build_env = {"DOCKER_BUILDKIT": "1"}
                return [client, "build"]
        raise Usage(f"no docker client with BuildKit: {self.docker} has no buildx plugin; "
                    "install docker-buildx, or docker.io (its /usr/bin/docker has BuildKit built in)")

    # ---------------------------------------------------------------------------------- engine

    def start_engine(self) -> None:
        if self.engine_host:
            os.environ["DOCKER_HOST"] = self.engine_host
            r = self.d("version", "--format", "{{.Server.Version}}", check=False, timeout=30)
            if r.returncode != 0:
                raise Usage(f"SMOKE_DOCKER_HOST={self.engine_host}: no Docker engine answers there "
                            f"({(r.stderr.strip().splitlines() or ['?'])[-1]})")
            self.engine_up = True
            log(f"using the running Docker engine {r.stdout.strip()} at {self.engine_host} "
                f"(not stopped afterwards)")
            return
        data_root = self.keep_root or self.tmp / "docker"
        data_root.mkdir(parents=True, exist_ok=True)
        self.exec_root = self.tmp / "exec"
        sock = self.tmp / "docker.sock"
        os.environ["DOCKER_HOST"] = f"unix://{sock}"
        logf = open(self.tmp / "dockerd.log", "w")
        # No default bridge (docker0), no iptables rules, no ip_forward: nothing on the host changes, and
        # containers reach only each other. Published ports go through docker-proxy.
        self.dockerd = subprocess.Popen(
            ["dockerd", "--host", f"unix://{sock}", "--data-root", str(data_root),
             "--exec-root", str(self.exec_root), "--pidfile", str(self.tmp / "dockerd.pid"),
             "--bridge=none", "--iptables=false", "--ip-forward=false", "--ip-masq=false"],
            stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        logf.close()
        deadline = time.monotonic() + 60
        while True:
            if self.dockerd.poll() is not None:
                tail((self.tmp / "dockerd.log").read_text(), 15, "dockerd: ")
                raise Failure(f"dockerd exited with status {self.dockerd.returncode} (its log is above)")
            r = self.d("version", "--format", "{{.Server.Version}}", check=False, timeout=10)
            if r.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise Failure("dockerd did not answer within 60s")
            time.sleep(0.5)
        self.engine_up = True
        kept = " (kept: KEEP_DOCKER_ROOT)" if self.keep_root else ""
        log(f"started dockerd {r.stdout.strip()} (pid {self.dockerd.pid}), data root {data_root}{kept}")

    def stop_engine(self) -> None:
        if self.dockerd is None:
            return
        containerd_pid = None
        with contextlib.suppress(OSError, ValueError):
            containerd_pid = int((self.exec_root / "containerd/containerd.pid").read_text())
        if self.dockerd.poll() is None:
            self.dockerd.terminate()
            try:
                self.dockerd.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.dockerd.kill()
                self.dockerd.wait()
        # dockerd stops the containerd it started; if it died first, that containerd is ours to stop.
        if containerd_pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(containerd_pid, 0)
                if "containerd" in Path(f"/proc/{containerd_pid}/cmdline").read_text(errors="replace"):
                    os.kill(containerd_pid, signal.SIGTERM)
        log(f"stopped dockerd (pid {self.dockerd.pid})")
        self.dockerd = None

    # ------------------------------------------------------------------------------------ image

    def base_image(self) -> str:
        if self.cpu_base:
            log(f"base: CPU_BASE={self.cpu_base}")
            return self.cpu_base
        for known in (LOCAL_BASE, PYTHON_BASE):
            if self.image_exists(known):
                log(f"base: {known}, already in the engine")
                return known
        if not shutil.which("debootstrap"):
            raise Usage("debootstrap not found (it makes the base image): apt-get install -y debootstrap, "
                        "or set CPU_BASE to an image")
        rootfs = self.tmp / "rootfs"
        log(f"base: debootstrap bookworm ({DEBOOTSTRAP_INCLUDE}) from {self.mirror}")
        with open(self.tmp / "debootstrap.log", "w") as f:
            # A session of its own: on Ctrl-C its whole group (wget, dpkg, chroot) is stopped, not just the
            # shell.
            self.debootstrap = subprocess.Popen(
                ["debootstrap", "--variant=minbase", f"--include={DEBOOTSTRAP_INCLUDE}", "bookworm",
                 str(rootfs), self.mirror],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = self.debootstrap.wait(timeout=900)
        except subprocess.TimeoutExpired:
            raise Failure("debootstrap did not finish within 900s") from None
        self.debootstrap = None
        if rc != 0:
            tail((self.tmp / "debootstrap.log").read_text(), 15, "debootstrap: ")
            raise Failure(f"debootstrap failed (exit {rc}; its log is above)")
        # This machine's CA bundle: pip in the build trusts what the host trusts (e.g. a proxy's CA).
        if CA_BUNDLE.is_file():
            shutil.copyfile(CA_BUNDLE, rootfs / "etc/ssl/certs/ca-certificates.crt")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run([self.docker, "import", "--change",
                              "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                              "--change", "ENV LANG=C.UTF-8", "-", LOCAL_BASE],
                             stdin=tar.stdout, capture_output=True, text=True, timeout=600)
        tar.stdout.close()
        tar.wait()
        if tar.returncode != 0 or imp.returncode != 0:
            raise Failure(f"docker import of the debootstrap tree failed: {imp.stderr.strip()[-200:]}")
        remove_tree(rootfs)
        log(f"base: imported {LOCAL_BASE}")
        return LOCAL_BASE

    def serve(self, folders: list[Path]) -> list[str]:
        """Serve the folders read-only on 127.0.0.1, one http.server over a directory of symlinks to them;
        returns their URLs. Port PKG_PORT when free, so the URLs (build arguments, part of the build
        cache key) stay the same between runs and a kept data root rebuilds from cache."""
        root = self.tmp / "packages"
        root.mkdir(exist_ok=True)
        names = []
        for folder in folders:
            name = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(folder).strip("/")) or "root"
            while (root / name).exists():
                name += "_"
            (root / name).symlink_to(folder.resolve(), target_is_directory=True)
            names.append(name)
        for port in (PKG_PORT, 0):
            p = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1",
                                  "--directory", str(root), str(port)],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 stdin=subprocess.DEVNULL, text=True, start_new_session=True)
            self.servers.append(p)
            m = re.search(r"port (\d+)", p.stdout.readline())  # "" when it could not bind: next port
            if m:
                return [f"http://127.0.0.1:{m.group(1)}/{n}/" for n in names]
        raise Failure("python3 -m http.server could not listen on 127.0.0.1")

    def stop_servers(self) -> None:
        for p in self.servers:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.servers = []

    def package_args(self) -> list[str]:
        """Build arguments for this machine's pip sources (see the module docstring)."""
        # pip as the caller runs it: the caller's HOME (user config), not the Ray CLI's private one.
        r = run([sys.executable, "-m", "pip", "config", "list"], check=False,
                env={**os.environ, **self.pip_env})
        conf: dict[str, list[str]] = {"index-url": [], "extra-index-url": [], "find-links": []}
        for line in r.stdout.splitlines():
            m = re.match(r"^[^=]*\.(index-url|extra-index-url|find-links)='(.*)'$", line.strip())
            if m:
                conf[m.group(1)] += [v for v in m.group(2).split() if v not in conf[m.group(1)]]
        local_indexes, remote, local_links, remote_links = [], [], [], []
        for url in conf["index-url"] + conf["extra-index-url"]:
            path = Path(url.removeprefix("file://")) if url.startswith(("file://", "/")) else None
            if path is None:
                remote.append(url)
            elif path.is_dir():
                local_indexes.append(path)
        for url in conf["find-links"]:
            path = Path(url.removeprefix("file://")) if url.startswith(("file://", "/")) else None
            if path is None:
                remote_links.append(url)
            elif path.is_dir():
                local_links.append(path)
        served = [*local_indexes, *local_links]
        if not served:
            log("image: no local package folders in `pip config list`: pip's remote indexes only")
            if not remote:
                return []
            return ["--build-arg", f"PIP_INDEX_URL={remote[0]}",
                    "--build-arg", f"PIP_EXTRA_INDEX_URL={' '.join(remote[1:])}",
                    *(["--build-arg", f"PIP_FIND_LINKS={' '.join(remote_links)}"] if remote_links else [])]
        # Simple-index pages link ../../files/...: serve an index's parent folder, point at the index in it.
        urls = self.serve([p.parent for p in local_indexes] + local_links)
        indexes = [u + p.name + "/" for u, p in zip(urls, local_indexes)]
        links = urls[len(local_indexes):] + remote_links
        log(f"image: serving {len(served)} local package folder(s) on {urls[0].split('/')[2]} for the build: "
            f"{', '.join(map(str, served))}")
        args = ["--build-arg", "TORCH_INDEX_URL="]
        if indexes:
            # Local indexes first; the host's own remote index (default: PyPI) last, for what only it has.
            extra = indexes[1:] + (remote or [PYPI])
            args += ["--build-arg", f"PIP_INDEX_URL={indexes[0]}",
                     "--build-arg", f"PIP_EXTRA_INDEX_URL={' '.join(extra)}"]
        if links:
            args += ["--build-arg", f"PIP_FIND_LINKS={' '.join(links)}"]
        return args

    def build_image(self, base: str) -> None:
        args = ["--build-arg", f"CPU_BASE={base}", *self.package_args()]
        vcs = run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=False).stdout.strip()
        cmd = [*self.build_cmd, "--progress=plain", "--network", "host", "-f", "docker/Dockerfile",
               "--target", "cpu", "-t", self.image, *args, "--build-arg", f"VCS_REF={vcs}",
               *self.extra_build_args, "."]
        log(f"building {self.image} (docker/Dockerfile, target cpu, base {base})")
        build_log = self.tmp / "build.log"
        with open(build_log, "w") as f:
            self.build = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env={**os.environ, **self.build_env},
                                          start_new_session=True)
        last_note = time.monotonic()
        while self.build.poll() is None:
            time.sleep(1)
            if time.monotonic() - last_note >= 30:
                last_note = time.monotonic()
                steps = re.findall(r"^#\d+ \[(cpu[^\]]*)\] (.*)$", build_log.read_text(errors="replace"),
                                   re.M)
                if steps:
                    log(f"building: [{steps[-1][0]}] {steps[-1][1][:90]}")
        rc = self.build.returncode
        self.build = None
        self.stop_servers()
        if rc != 0:
            tail(build_log.read_text(errors="replace"), 40, "build: ")
            raise Failure(f"docker build failed (exit {rc}; the end of its log is above)")
        size = self.d("image", "inspect", "-f", "{{.Size}}", self.image).stdout.strip()
        log(f"built {self.image} ({int(size) / 1e9:.1f} GB)")

    def run_user_task(self) -> None:
        """examples/tabular/Dockerfile on the image just built, as docs/your-own-model.md tells a user to
        add a task: the task's package copied in, on PYTHONPATH; then 20 steps of it in a container
        locked down as the cluster's (read-only root, no capabilities, the image's user, no network)."""
        repo, _, tag = self.image.rpartition(":")
        self.task_image = f"{repo}-tabular:{tag}"
        build = self.build_cmd or [self.docker, "build"]
        r = run([*build, "-f", "examples/tabular/Dockerfile", "--build-arg", f"BASE={self.image}", "-t",
                 self.task_image, "examples/tabular"], cwd=REPO, check=False, timeout=300,
                env={**os.environ, **self.build_env})
        if r.returncode != 0:
            tail(r.stdout + r.stderr, 30, "task build: ")
            raise Failure(f"docker build of examples/tabular/Dockerfile on {self.image} failed "
                          f"(exit {r.returncode})")
        r = self.d("run", "--rm", "--label", self.label, "--network", "none", "--read-only",
                   "--tmpfs", "/tmp:rw,nosuid,nodev,noexec,size=1g", "--cap-drop=ALL",
                   "--security-opt=no-new-privileges",
                   self.task_image, "python", "-m", "trainapp", "train",
                   "--config", "/home/trainapp/tasks/config.yaml",
                   "train.max_steps=20", "train.progress=false", "run.dir=/tmp/run", check=False, timeout=300)
        done = [line for line in r.stdout.splitlines() if line.startswith("trainapp: done steps=20")]
        if r.returncode != 0 or not done or "val_mse=" not in done[0]:
            tail(r.stdout + r.stderr, 30, "task: ")
            raise Failure(f"the user's task in {self.task_image} did not train (exit {r.returncode})")
        log(f"user task: {done[0]}")
        self.summaries.append(f"a user's task added with FROM ({self.task_image}) trained 20 steps")

    # ---------------------------------------------------------------------------------- cluster

    def render(self, target: str) -> tuple[str, str]:
        """`make TARGET`'s rendered YAML, and how it was made."""
        r = run(["make", "-s", "-C", str(REPO), target], check=False)
        if r.returncode != 0:
            raise Usage(f"make {target} failed: {(r.stderr or r.stdout).strip()[-200:]} (it needs kubectl)")
        return r.stdout, f"make {target}"

    def load(self, text: str, how: str) -> tuple[Objects, dict, dict]:
        """The rendered objects (RayClusters as KubeRay builds their pods), the Secret a user makes with
        `make k8s-token`, every field checked; and its Ray head and worker Deployments."""
        objects = Objects.load(text, REPO / "k8s")
        kuberay.expand(objects)
        ns = next((namespace_of(o) for o in objects.of_kind("Deployment")), "default")
        # `make k8s-token`: the Secret every Ray pod reads its token from (never committed).
        objects.add({"apiVersion": "v1", "kind": "Secret",
                     "metadata": {"name": "ray-auth-token", "namespace": ns},
                     "stringData": {"token": os.environ["RAY_AUTH_TOKEN"]}})
        check_fields(objects)
        deployments = objects.of_kind("Deployment")
        ray = [d for d in deployments if preflight.is_ray_pod(d["spec"]["template"]["spec"]["containers"][0])]
        heads = [d for d in ray if preflight.is_head(d["spec"]["template"]["spec"]["containers"][0])]
        if len(heads) != 1 or len(ray) != 2:
            raise Failure(f"{how}: expected one Ray head Deployment and one of Ray workers, found "
                          f"{', '.join(ref(d) for d in deployments) or 'none'}")
        log(f"manifests: {how}: {len(objects.items)} objects; "
            + ", ".join(f"{ref(d)} x{d['spec'].get('replicas', 1)} ({objects.source(d)})"
                        for d in deployments))
        return objects, heads[0], next(d for d in ray if d is not heads[0])

    def manifests(self) -> None:
        """The kind overlays as `make k8s-render-kind` and `make k8s-render-kind-kuberay` print them, and the
        job of k8s/kuberay/rayjob.train.yaml; every field checked before anything starts."""
        if self.env.get("SMOKE_RENDERED_FILE"):
            text, how = (Path(self.env["SMOKE_RENDERED_FILE"]).read_text(),
                         f"SMOKE_RENDERED_FILE={self.env['SMOKE_RENDERED_FILE']}")
        else:
            text, how = self.render("k8s-render-kind")
        self.objects, self.head_dep, self.worker_dep = self.load(text, how)
        self.kuberay_objects = self.load(*self.render("k8s-render-kind-kuberay"))
        rayjob = yaml.safe_load(RAYJOB.read_text())
        self.entrypoint = " ".join(rayjob["spec"]["entrypoint"].split())
        self.runtime_env = yaml.safe_load(rayjob["spec"].get("runtimeEnvYAML") or "{}") or {}
        self.job_source = f"{RAYJOB.relative_to(REPO)} spec.entrypoint"

    def module_in_image(self, mod: str) -> bool:
        return self.image_has(f"importlib.util.find_spec({mod!r}) is not None")

    def check_manifests(self) -> None:
        """preflight.check with the image: its modules and files, one container per question."""
        for objects in (self.objects, self.kuberay_objects[0]):
            preflight.check(objects, module_exists=self.module_in_image,
                            file_in_image=lambda path: self.image_has(f"os.path.isfile({path!r})"),
                            jobs=[preflight.Job(self.entrypoint, self.job_source)])
        log("manifests: every pod template field implemented; modules, Service names and paths checked")

    def image_has(self, expr: str) -> bool:
        if expr not in self.image_answers:
            image = self.head_dep["spec"]["template"]["spec"]["containers"][0]["image"]
            r = self.d("run", "--rm", "--label", self.label, "--network", "none", "--entrypoint", "python",
                       image, "-c", f"import importlib.util, os, sys; sys.exit(0 if {expr} else 1)",
                       check=False)
            self.image_answers[expr] = r.returncode == 0
        return self.image_answers[expr]

    def job_server_ready(self) -> bool:
        try:
            self.jobs_api()
            return True
        except (OSError, ValueError):
            time.sleep(1)
            return False

    def pod_ip(self, deployment: dict) -> str:
        return self.k8s.of(deployment["metadata"]["name"])[0].plan.ip

    def alive_nodes(self) -> int:
        """Ray nodes alive, from `ray status` on the head: the Active and Idle lines (" 1 node_ab12..." or,
        with the node types KubeRay's environment names, " 2 cpu")."""
        r = self.d("exec", self.head, "ray", "status", check=False, timeout=60)
        alive = r.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in r.stdout else ""
        return sum(int(m) for m in re.findall(r"^\s*(\d+)\s+\S+\s*$", alive, re.M))

    def start_cluster(self) -> None:
        """The Deployments' pods from their templates, the head's first (a worker's `ray start` gives up when
        no GCS answers; on a cluster the kubelet would restart it until the head is up)."""
        self.k8s = Runtime(self.objects, docker=self.d, label=self.label, prefix=f"trainapp-smoke-{self.id}",
                           workdir=self.tmp, log=log)
        self.k8s.up()
        log(f"pods: network {self.k8s.network} ({self.k8s.subnet}), the claims as Docker volumes")
        self.start_ray(self.head_dep, self.worker_dep)

    def start_ray(self, head_dep: dict, worker_dep: dict) -> None:
        """The head's pods, ready; then the workers', ready; then Ray's job server and nodes."""
        head_name, workers_name = head_dep["metadata"]["name"], worker_dep["metadata"]["name"]
        self.head_dep, self.worker_dep = head_dep, worker_dep
        self.k8s.apply(head_dep)
        self.head = self.k8s.wait_ready(head_name, 1, 180)[0].name
        self.port_host = self.pod_ip(head_dep)
        self.k8s.apply(worker_dep)
        replicas = int(worker_dep["spec"].get("replicas", 1))
        self.k8s.wait_ready(workers_name, replicas, 180)
        deadline = time.monotonic() + 120
        while not self.job_server_ready():
            if time.monotonic() > deadline:
                raise Failure(f"the head's job server on {self.port_host}:8265 accepts no requests "
                              "after 120s")
        while (n := self.alive_nodes()) < 1 + replicas:
            if time.monotonic() > deadline:
                raise Failure(f"{n} of {1 + replicas} Ray nodes alive 120s after every pod was ready")
            time.sleep(2)
        log(f"cluster up: {1 + replicas} Ray nodes; the dashboard at the head pod's {self.port_host}:8265 "
            f"(what `kubectl port-forward svc/ray-head 8265` gives a user)")
        self.check_services(self.workers[0])

    def check_services(self, client: str) -> None:
        """Every Service's names, short to cluster.local, resolve to the pods it selects, from a pod."""
        for svc in self.objects.of_kind("Service"):
            name, ns = svc["metadata"]["name"], namespace_of(svc)
            ips = sorted(p.plan.ip for p in self.k8s.pods.values()
                         if not p.deleting and selects(svc, p.plan.labels))
            names = dns_names(name, ns)
            code = ("import socket, sys; print(' '.join(sorted({a[4][0] for n in sys.argv[1:] "
                    "for a in socket.getaddrinfo(n, None, socket.AF_INET)})))")
            r = self.d("exec", client, "python", "-c", code, *names, check=False, timeout=60)
            got = r.stdout.split()
            if r.returncode != 0 or got != ips:
                said = got or (r.stderr.strip().splitlines() or ["nothing"])[-1]
                raise Failure(f"{self.objects.source(svc)} {ref(svc)}: {', '.join(names)} resolve to {said} "
                              f"from pod {client}, not to the pods it selects ({', '.join(ips) or 'none'})")
            log(f"{ref(svc)} ({self.objects.source(svc)}): {', '.join(names)} resolve to {', '.join(ips)} "
                f"from pod {client}")

    @property
    def workers(self) -> list[str]:
        return [p.name for p in self.k8s.of(self.worker_dep["metadata"]["name"])]

    # -------------------------------------------------------------------------------------- job

    def submit(self, name: str, steps: int) -> float:
        """Submit a run named `name` (its job id too) and make it the current job; returns its deadline.
        The entrypoint and runtime env are the RayJob's, then the smoke's overrides (its sizes and steps;
        ray.num_workers=2: the two one-CPU worker pods, where the entrypoint's elastic [1,4] would go on with
        one after a loss and change what the checks count)."""
        # As separate words: the Ray CLI quotes each one for the head's shell.
        cmd = [*shlex.split(self.entrypoint), *train_args(steps, name)]
        env = {**os.environ, "NO_PROXY": self.port_host, "no_proxy": self.port_host}
        run([self.ray, "job", "submit", "--address", f"http://{self.port_host}:8265", "--submission-id", name,
             "--no-wait", "--runtime-env-json", json.dumps(self.runtime_env), "--", *cmd], env=env)
        self.job, self.submitted, self.last_status = name, True, 0.0
        log(f"submitted job {name}: {self.job_source} + {len(train_args(steps, name))} overrides "
            f"({steps} steps, a snapshot every {EVERY})")
        return time.monotonic() + self.timeout

    def keep_waiting(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise Failure(f"{what} within TIMEOUT={self.timeout}s")
        if time.monotonic() - self.last_status > 5:
            self.check_job_alive()
            self.last_status = time.monotonic()

    def wait_for_step(self, at: int, deadline: float) -> tuple[int, list[dict]]:
        step, records = 0, []
        while step < at:
            self.keep_waiting(deadline, f"the run never reached step {at} (at {step})")
            time.sleep(0.5)
            records = self.records()
            step = smoke_assert.max_train_step(records)
        return step, records

    def pick_victim(self, records: list[dict]) -> tuple[str, str]:
        """Rank 0's pod if the start record says which host it is (trainapp's `network` field): that rank
        writes the snapshots, so losing it is the harder case. Also checks that network.interface=auto
        chose eth0 on every rank."""
        victim, why = self.workers[0], ""
        start = next((r for r in records if r.get("kind") == "start"), {})
        nets = [n for n in start.get("network") or [] if isinstance(n, dict)]
        if nets:
            log("ranks: " + ", ".join(f"{i} on {n.get('host')} (gloo={n.get('gloo')}, nccl={n.get('nccl')}"
                                      f"{', kept ' + ','.join(n['kept']) if n.get('kept') else ''})"
                                      for i, n in enumerate(nets)))
        auto = [n for n in nets if str(n.get("reason", "")).startswith("auto") and n.get("gloo") == "eth0"
                and not n.get("kept")]
        if not nets or len(auto) != len(nets):
            raise Failure(f"network.interface=auto did not choose eth0 (toward the head) on every rank: "
                          f"{nets}")
        if nets and nets[0].get("host") in self.workers:
            victim, why = nets[0]["host"], " (rank 0's pod)"
        return victim, why

    def wait_restart(self, deadline: float, what: str) -> dict:
        while True:
            self.keep_waiting(deadline, what)
            time.sleep(1)
            restart = smoke_assert.latest_restart(self.records())
            if restart is not None:
                if restart.get("resumed_step") is None:
                    raise Failure("the run restarted from scratch instead of from a snapshot")
                return restart

    def wait_succeeded(self, deadline: float) -> None:
        status = ""
        while status != "SUCCEEDED":
            if time.monotonic() > deadline:
                raise Failure(f"job {self.job} did not finish within TIMEOUT={self.timeout}s "
                              f"(status {status or '?'})")
            time.sleep(3)
            status = self.job_status()
            if status in ("FAILED", "STOPPED"):
                raise Failure(f"job {self.job} is {status} (its log is below)")
        log(f"job {self.job} succeeded; checking the run directory and the pods' users")

    def run_job(self) -> None:
        """The kill case: a worker pod deleted with --grace-period=0 --force (SIGKILL, no preStop: what a
        lost node looks like) between two snapshots; the Deployment replaces it."""
        deadline = self.submit(self.name, STEPS)
        step, records = self.wait_for_step(KILL_AT, deadline)
        victim, why = self.pick_victim(records)
        killed_at, self.kill_step = time.time(), step
        log(f"deleting worker pod {victim}{why} at step {step} with --grace-period=0 --force")
        self.k8s.delete(victim, grace=0)
        resumed = self.wait_restart(deadline, f"the run never restarted after {victim} was killed")
        self.resumed_step = resumed["resumed_step"]
        log(f"resumed from step {self.resumed_step} (killed at {step}), "
            f"{resumed['time'] - killed_at:.1f}s after the kill, world size {resumed.get('world_size')}; "
            f"waiting for the job to finish")
        self.wait_succeeded(deadline)

    def run_stop_job(self) -> None:
        """The stop case: a worker pod deleted as `kubectl delete pod` does between two snapshots: its
        preStop hook (`trainapp drain`) drains the node, then SIGTERM, SIGKILL only after
        terminationGracePeriodSeconds; the run stops with a snapshot of the step reached and resumes from
        it."""
        deadline = self.submit(self.stop_name, STOP_STEPS)
        step, records = self.wait_for_step(STOP_AT, deadline)
        victim, why = self.pick_victim(records)
        grace = self.k8s.pods[victim].plan.grace_s
        stopped_at = time.time()
        log(f"deleting worker pod {victim}{why} at step {step} (terminationGracePeriodSeconds {grace:g})")
        took, code, said = self.k8s.delete(victim)
        self.stop_step, self.stop_took, self.stop_code = step, took, code
        if code == "137" or took >= grace:
            raise Failure(f"{self.k8s.gone[-1].describe()}: stopping took {took:.1f}s and it exited with "
                          f"{code}: "
                          f"SIGKILLed at the grace period ({grace:g}s) instead of exiting after the drain")
        if code not in ("143", "0"):
            raise Failure(f"{self.k8s.gone[-1].describe()}: exited with {code} after preStop and SIGTERM "
                          f"(expected 143 from `trainapp node`, or 0)")
        if said and not said.startswith("passed"):
            raise Failure(f"{self.k8s.gone[-1].describe()}: its preStop hook {said}")
        resumed = self.wait_restart(deadline, f"the run never restarted after {victim} was deleted")
        notice = smoke_assert.latest_preempted(self.records())
        if notice is None:
            raise Failure(f"the run restarted after {victim} was deleted without a `preempted` record: "
                          "the notice did not reach the training processes (no snapshot of the step reached)")
        self.stop_preempted, self.stop_resumed = notice.get("step"), resumed["resumed_step"]
        self.stop_snapshot_s = notice["time"] - stopped_at
        log(f"preempted at step {notice.get('step')} ({notice.get('signal')}, phase {notice.get('phase')}): "
            f"its snapshot {self.stop_snapshot_s:.1f}s after the deletion "
            f"({notice.get('seconds')}s after the signal); resumed from step {self.stop_resumed}, "
            f"{resumed['time'] - stopped_at:.1f}s after the deletion, "
            f"world size {resumed.get('world_size')}; "
            f"waiting for the job to finish")
        self.wait_succeeded(deadline)

    def mutation(self) -> None:
        """A manifest changed in a copy (the worker command's module name) fails in one line naming its
        Deployment, twice: in the preflight, and at run time with the preflight skipped."""
        dep = copy.deepcopy(self.worker_dep)
        command = dep["spec"]["template"]["spec"]["containers"][0]["command"]
        i = command.index("-m") + 1
        command[i] += "_renamed"
        dep["spec"]["replicas"] = 1
        broken = copy.deepcopy(self.objects)
        broken.items = [dep if o is self.worker_dep else o for o in self.objects.items]
        try:
            preflight.check(broken, file_in_image=lambda p: True, module_exists=self.module_in_image)
            raise Failure(f"preflight passed a worker command running `python -m {command[i]}`")
        except ManifestError as e:
            log(f"mutation (preflight): {e}")
        self.k8s.replace = False
        pod = self.k8s.create(dep)
        try:
            self.k8s.wait_ready(dep["metadata"]["name"], 1, 60, only=[pod.name])
            raise Failure(f"a worker pod running `python -m {command[i]}` became ready")
        except PodFailure as e:
            if "No module named" not in str(e) or ref(dep) not in str(e):
                raise Failure(f"the mutated worker pod failed, but not naming its Deployment and the "
                              f"module: {e}") from None
            log(f"mutation (run time): {e}")
        finally:
            self.k8s.delete(pod.name, grace=0)
        self.summaries.append(f"a worker command's module renamed in a copy fails in one line, in the "
                              f"preflight and at run time ({ref(dep)})")

    def kuberay(self) -> None:
        """The RayCluster of k8s/overlays/kind-cpu-kuberay: its pods as KubeRay builds them (the operator's
        `ray start` command, environment, init container and head Service; scripts/dockerlet/kuberay.py),
        then a short run of the RayJob's entrypoint on them. The Deployments' pods go first: one Ray
        cluster at a time on this machine's cores."""
        self.k8s.replace = False
        for name in list(self.k8s.pods):
            self.k8s.delete(name, grace=0)
        objects, head, workers = self.kuberay_objects
        self.objects = self.k8s.objects = objects
        self.k8s.replace = True
        self.start_ray(head, workers)
        name = f"{self.name}-kuberay"
        deadline = self.submit(name, KUBERAY_STEPS)
        self.wait_succeeded(deadline)
        step = smoke_assert.max_train_step(self.records())
        if step != KUBERAY_STEPS:
            raise Failure(f"the run on the KubeRay pods ended at step {step}, not {KUBERAY_STEPS}")
        # The pods' 3 GiB limit leaves no room for a spare beside a training worker: the run says so (a
        # spare there had Ray's memory monitor end the worker).
        said = [line for line in self.jobs_api(f"{self.job}/logs").get("logs", "").splitlines()
                if "ray.spare_workers:" in line]
        for line in said:
            log(f"the job said: {line.strip()}")
        self.summaries.append(f"the RayCluster's pods as KubeRay {kuberay.KUBERAY_VERSION} builds them "
                              f"trained {KUBERAY_STEPS} steps"
                              + (f" ({len(said)} line(s) on spares without memory)" if said else ""))

    def liveness(self) -> None:
        """A copy of the worker template whose liveness probe checks a port nothing listens on: the runner
        restarts its container (its command only sleeps: no Ray node joins the cluster)."""
        dep = copy.deepcopy(self.worker_dep)
        source = self.objects.source(dep)
        dep["metadata"]["name"] += "-liveness"
        self.objects.sources[("Deployment", dep["metadata"]["name"])] = f"a copy of {source}"
        spec = dep["spec"]["template"]["spec"]
        c = spec["containers"][0]
        c["command"], c["args"] = ["python", "-c", "import time; time.sleep(600)"], []
        c.pop("lifecycle", None)
        c.pop("readinessProbe", None)
        c["livenessProbe"] = {"tcpSocket": {"port": 6399}, "periodSeconds": 1, "failureThreshold": 2}
        spec["terminationGracePeriodSeconds"] = 2
        pod = self.k8s.create(dep)
        deadline = time.monotonic() + 60
        try:
            while pod.restarts == 0:
                if time.monotonic() > deadline:
                    raise Failure(f"{pod.describe()}: its failing liveness probe did not restart it in 60s")
                time.sleep(0.5)
            if not pod.reason.startswith("liveness probe failed"):
                raise Failure(f"{pod.describe()}: restarted, but for {pod.reason!r}")
        finally:
            self.k8s.delete(pod.name, grace=0)
        self.summaries.append(f"a failing liveness probe restarted its container "
                              f"({time.monotonic() - pod.created:.0f}s)")

    def check(self, name: str, steps: int, *extra: str) -> None:
        cmd = [sys.executable, str(REPO / "scripts/smoke_assert.py"), f"{RUNS}/{name}", "--backend", "docker",
               "--docker-container", self.head, "--dest", str(self.tmp / "copy" / name),
               "--expect-steps", str(steps), *extra]
        for c in self.k8s.containers():
            cmd += ["--nonroot", c]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        print((r.stdout + r.stderr).rstrip(), flush=True)
        if r.returncode != 0:
            raise Failure(f"smoke_assert.py found a problem in {RUNS}/{name}")

    def check_kill(self) -> None:
        self.check(self.name, STEPS)
        line = (f"kill: worker pod deleted with --force (SIGKILL) at step {self.kill_step}, "
                f"resumed from step {self.resumed_step}, {STEPS}/{STEPS} steps")
        log(f"PASS {line}")
        self.summaries.append(line)

    def check_stop(self) -> None:
        self.check(self.stop_name, STOP_STEPS, "--preempted", "SIGTERM")
        line = (f"stop: worker pod deleted at step {self.stop_step} "
                f"(preStop + SIGTERM {self.stop_took:.0f}s, exit {self.stop_code}), snapshot of step "
                f"{self.stop_preempted} {self.stop_snapshot_s:.1f}s after the deletion, resumed from step "
                f"{self.stop_resumed} ({self.stop_preempted - self.stop_resumed} redone), "
                f"{STOP_STEPS}/{STOP_STEPS} steps")
        log(f"PASS {line}")
        self.summaries.append(line)

    # ----------------------------------------------------------------------------- diagnostics

    def diagnostics(self) -> None:
        if not self.engine_up:
            return
        print(f"{PROG}: diagnostics", flush=True)
        r = self.d("ps", "-a", "--filter", f"label={self.label}", "--format", "{{.Names}}\t{{.Status}}",
                   check=False)
        tail(r.stdout, 10, "")
        for name in r.stdout.split():
            if name.startswith("trainapp-smoke-"):
                logs = self.d("logs", "--tail", "8", name, check=False)
                tail(logs.stdout + logs.stderr, 8, f"{name.removeprefix(f'trainapp-smoke-{self.id}-')}: ")
        if self.submitted:
            with contextlib.suppress(OSError, ValueError):
                tail(self.jobs_api(f"{self.job}/logs").get("logs", ""), 40, "job: ")

    @staticmethod
    def stop_group(proc: subprocess.Popen) -> None:
        """Stop a process started with start_new_session=True and everything in its process group."""
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # The group may outlive its leader for a moment: wait until no member is left.
        for _ in range(50):
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)

    def teardown(self) -> None:
        if self.debootstrap is not None:
            self.stop_group(self.debootstrap)
        if self.build is not None and self.build.poll() is None:
            self.build.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.build.wait(timeout=30)
        self.stop_servers()
        if self.engine_up:
            if self.k8s is not None:
                gone = self.k8s.down()
            else:
                ids = self.d("ps", "-aq", "--filter", f"label={self.label}", check=False).stdout.split()
                if ids:
                    self.d("rm", "-f", *ids, check=False, timeout=120)
                gone = [f"{len(ids)} containers"] if ids else []
            if self.task_image and self.d("rmi", self.task_image, check=False).returncode == 0:
                gone.append(f"image {self.task_image}")
            if gone:
                log(f"removed {', '.join(gone)}")
        self.stop_engine()
        if self.tmp is not None:
            remove_tree(self.tmp)
        if self.keep_root is not None:
            for mp in mounts_under(self.keep_root):  # left by a dockerd that had to be killed
                subprocess.run(["umount", "-l", mp], capture_output=True)

    # -------------------------------------------------------------------------------------- all

    def main(self) -> int:
        rc = 1
        try:
            self.preflight()
            self.tmp_parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix="container-smoke-", dir=self.tmp_parent))
            os.chmod(self.tmp, 0o700)
            # The Ray CLI: token from here, and a HOME of its own (a stale ~/.ray/auth_token must not leak
            # in).
            os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
                              HOME=str(self.tmp), RAY_USAGE_STATS_ENABLED="0")
            with self.timed("engine"):
                self.start_engine()
            self.manifests()  # before the build: a manifest the runner cannot run fails in seconds
            if self.skip_build:
                if not self.image_exists(self.image):
                    raise Usage(f"SKIP_BUILD=1 but the engine has no image {self.image}")
                log(f"building: skipped (SKIP_BUILD=1), using {self.image}")
            else:
                with self.timed("base"):
                    base = self.base_image()
                with self.timed("image"):
                    self.build_image(base)
            with self.timed("user task"):
                self.run_user_task()
            with self.timed("cluster"):
                self.check_manifests()
                self.start_cluster()
            with self.timed("job"):
                self.run_job()
            with self.timed("checks"):
                self.check_kill()
            with self.timed("stop job"):
                self.run_stop_job()
            with self.timed("stop checks"):
                self.check_stop()
            with self.timed("mutation"):
                self.mutation()
                self.liveness()
            with self.timed("kuberay"):
                self.kuberay()
            self.detail = "; ".join(self.summaries) + "; every process non-root"
            rc = 0
        except Usage as e:
            self.detail, rc = str(e), 2
            log(f"error: {e}")
        except (Failure, ManifestError, PodFailure) as e:
            trouble = self.k8s.trouble() if self.k8s is not None and not isinstance(e, PodFailure) else ""
            self.detail = str(e) + (f"; {trouble}" if trouble and trouble not in str(e) else "")
            log(f"error: {self.detail}")
            with contextlib.suppress(Exception):
                self.diagnostics()
        except (KeyboardInterrupt, Interrupted):
            self.detail, rc = f"interrupted during: {self.stage}", 130
            log("interrupted")
        except Exception as e:  # a bug here: still clean up, and say where
            self.detail = f"{e.__class__.__name__} during {self.stage}: {e}"
            log(f"error: {self.detail}")
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # one Ctrl-C does not cut the teardown short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with self.timed("teardown"):
                try:
                    self.teardown()
                except Exception as e:  # report, never hide the test's own result
                    log(f"teardown: {e.__class__.__name__}: {e}")
        stages = ", ".join(f"{k} {v:.0f}s" for k, v in self.timings.items())
        result = "PASS" if rc == 0 else "FAIL"
        print(f"{PROG}: {result} in {time.monotonic() - T0:.0f}s: {self.detail} ({stages})", flush=True)
        return rc


def _interrupt(signum, frame):
    raise Interrupted()


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        smoke = Smoke(dict(os.environ))
    except Usage as e:
        print(f"{PROG}: FAIL: {e}", flush=True)
        return 2
    return smoke.main()


if __name__ == "__main__":
    sys.exit(main())
