"""Pods as Docker containers: started from their plans, probed on their periods, restarted, deleted and
replaced as a kubelet and a Deployment controller would.

A daemon thread ticks every half second: it runs the probes that are due (tcpSocket and httpGet from this
host to the pod's IP, as the kubelet probes from the node; exec through `docker exec`), restarts a
container that exited or failed its liveness or startup probe (restartPolicy Always, back-off 10 s doubled
up to 5 min), and notes when a pod became ready. Deletion runs in the caller's thread, as `kubectl delete
pod` would start it: the Deployment's replacement is created at once, then the preStop hook runs, then
SIGTERM (the image's stop signal), then SIGKILL when terminationGracePeriodSeconds have passed.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .manifests import Objects, ref
from .podspec import Action, PodContext, PodPlan, template_hash, translate
from .probes import ContainerProbes

BACKOFF_S, BACKOFF_MAX_S = 10.0, 300.0
TICK_S = 0.5


class PodFailure(Exception):
    """A pod did not become ready, or its container failed: the message names its Deployment."""


@dataclass
class Pod:
    plan: PodPlan
    deployment: dict
    created: float
    probes: ContainerProbes
    restarts: int = 0
    deleting: bool = False
    ready_at: float | None = None
    exits: list[str] = field(default_factory=list)  # "exit CODE: last log line" of each container that ended
    restart_at: float | None = None
    reason: str = ""  # why the last restart happened

    @property
    def name(self) -> str:
        return self.plan.name

    def describe(self) -> str:
        return f"{self.plan.owner} ({self.plan.source}) pod {self.name}"


def free_subnet(routes: str, prefix: str = "10.244") -> str:
    """A /24 under prefix that overlaps none of this host's routes (`ip -4 route` output)."""
    taken = []
    for line in routes.splitlines():
        word = line.split()[0] if line.split() else ""
        if word == "default":
            continue
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.ip_network(word, strict=False))
    for n in range(100, 250):
        net = ipaddress.ip_network(f"{prefix}.{n}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return str(net)
    raise RuntimeError(f"no free /24 under {prefix}.0.0/16 on this host")


class Runtime:
    """One namespace's pods on one Docker network."""

    def __init__(
        self,
        objects: Objects,
        *,
        docker: Callable[..., subprocess.CompletedProcess],
        label: str,
        prefix: str,
        workdir: Path,
        log: Callable[[str], None],
    ):
        self.objects, self.d, self.label, self.prefix, self.log = objects, docker, label, prefix, log
        self.workdir = workdir
        self.network = f"{prefix}-net"
        self.subnet = ""
        self.next_host = 10
        self.pods: dict[str, Pod] = {}
        self.gone: list[Pod] = []
        self.claims: set[str] = set()
        self.image_users: dict[str, str] = {}
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.network_made = False
        self.replace = True  # the Deployment controller's part: a deleted pod's replacement

    # ------------------------------------------------------------------------------------ setup

    def up(self) -> None:
        routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        self.subnet = free_subnet(routes)
        self.d("network", "create", "--label", self.label, "--subnet", self.subnet, self.network)
        self.network_made = True
        self.thread = threading.Thread(target=self._loop, name="dockerlet", daemon=True)
        self.thread.start()

    def _ip(self) -> str:
        net = ipaddress.ip_network(self.subnet)
        ip = str(net.network_address + self.next_host)
        self.next_host += 1
        return ip

    def _image_user(self, image: str) -> str:
        if image not in self.image_users:
            self.image_users[image] = self.d(
                "image", "inspect", "-f", "{{.Config.User}}", image
            ).stdout.strip()
        return self.image_users[image]

    def _claim(self, volume: str, fs_group: int | None, image: str) -> None:
        """A claim's Docker volume, made once; fsGroup owns its root (group, setgid), as the kubelet's
        fsGroupChangePolicy OnRootMismatch does on the first mount."""
        if volume in self.claims:
            return
        self.d("volume", "create", "--label", self.label, volume)
        self.claims.add(volume)
        if fs_group is not None:
            self.d(
                "run",
                "--rm",
                "--label",
                self.label,
                "--network",
                "none",
                "--user",
                "0:0",
                "--cap-drop=ALL",
                "--cap-add=CHOWN",
                "--cap-add=FOWNER",
                "--entrypoint",
                "sh",
                "-v",
                f"{volume}:/v",
                image,
                "-c",
                f"chgrp {fs_group} /v && chmod 2775 /v",
            )

    # ------------------------------------------------------------------------------- pods

    def apply(self, deployment: dict) -> list[Pod]:
        """spec.replicas pods of the Deployment."""
        return [self.create(deployment) for _ in range(int(deployment["spec"].get("replicas", 1)))]

    def plan(self, deployment: dict, name: str = "", ip: str = "") -> PodPlan:
        name = (
            name or f"{deployment['metadata']['name']}-{template_hash(deployment)}-{secrets.token_hex(3)[:5]}"
        )
        image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
        ctx = PodContext(
            name=name,
            ip=ip or self._ip(),
            network=self.network,
            pod_dir=self.workdir / "pods" / name,
            volume_prefix=self.prefix,
            label=self.label,
            image_user=self._image_user(image),
        )
        return translate(self.objects, deployment, ctx)

    def create(self, deployment: dict) -> Pod:
        with self.lock:
            plan = self.plan(deployment)
        for volume in plan.claims:
            self._claim(volume, plan.fs_group, plan.image)
        for i, step in enumerate(plan.init):
            write_files(step)
            name = f"{plan.name}-init-{i}"
            self.d("create", "--name", name, *step.create_args)
            r = self.d("start", "--attach", name, check=False, timeout=600)
            self.d("rm", "-f", name, check=False)
            lines = (r.stdout + r.stderr).strip().splitlines()
            said = f"init container {step.container} exited {r.returncode}"
            said += f": {lines[-1]}" if lines else ""
            self.log(f"{plan.owner} ({plan.source}) pod {plan.name}: {said}")
            if r.returncode != 0:
                raise PodFailure(f"{plan.owner} ({plan.source}) pod {plan.name}: {said}")
        write_files(plan)
        self.d("create", "--name", plan.name, *plan.create_args)
        self.d("start", plan.name)
        now = time.monotonic()
        pod = Pod(plan, deployment, now, ContainerProbes(plan.probes, now))
        with self.lock:
            self.pods[plan.name] = pod
        self.log(f"{pod.describe()}: created, IP {plan.ip}")
        if plan.post_start is not None:
            ok, out = self.act(pod, plan.post_start, timeout=pod.plan.grace_s)
            if not ok:
                self.log(f"{pod.describe()}: postStart failed ({out}): restarting it")
                self._restart(pod, "postStart failed")
        return pod

    def of(self, deployment_name: str) -> list[Pod]:
        with self.lock:
            return [
                p
                for p in self.pods.values()
                if p.deployment["metadata"]["name"] == deployment_name and not p.deleting
            ]

    def containers(self) -> list[str]:
        with self.lock:
            return [p.name for p in self.pods.values() if not p.deleting]

    def states(self, pods: list[Pod]) -> dict[str, tuple[bool, int]]:
        """Running and exit code of every pod's container, in one `docker inspect` (a pod whose container
        is gone: not running, -1)."""
        if not pods:
            return {}
        r = self.d("inspect", "-f", "{{.Name}} {{.State.Running}} {{.State.ExitCode}}",
                   *[p.name for p in pods], check=False, timeout=30)
        found = {}
        for line in r.stdout.splitlines():
            name, running, code = line.split()
            found[name.lstrip("/")] = (running == "true", int(code))
        return {p.name: found.get(p.name, (False, -1)) for p in pods}

    def last_log(self, pod: Pod, n: int = 1) -> str:
        r = self.d("logs", "--tail", str(n), pod.name, check=False, timeout=30)
        lines = (r.stdout + r.stderr).strip().splitlines()
        return " | ".join(lines[-n:]) if lines else "no output"

    # ------------------------------------------------------------------------------- actions

    def act(self, pod: Pod, action: Action, timeout: float) -> tuple[bool, str]:
        """Run a probe's or hook's action against the pod; (passed, what it said)."""
        try:
            if action.kind == "exec":
                r = self.d("exec", pod.name, *action.command, check=False, timeout=timeout)
                out = (r.stdout + r.stderr).strip().splitlines()
                return r.returncode == 0, f"exit {r.returncode}" + (f": {out[-1]}" if out else "")
            if action.kind == "tcp":
                with socket.create_connection((pod.plan.ip, action.port), timeout=timeout):
                    return True, "connected"
            if action.kind == "http":
                req = urllib.request.Request(
                    f"http://{pod.plan.ip}:{action.port}{action.path}", headers=action.headers
                )
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with opener.open(req, timeout=timeout) as r:
                    return 200 <= r.status < 400, f"HTTP {r.status}"
            if action.kind == "sleep":
                time.sleep(action.seconds)
                return True, f"slept {action.seconds:g}s"
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:g}s"
        except Exception as e:  # a refused connection, an HTTP error: the probe failed
            return False, f"{e.__class__.__name__}: {e}"
        return False, f"unknown action {action.kind}"

    def _stop(self, pod: Pod, grace: float) -> tuple[float, str, str]:
        """preStop, then SIGTERM, then SIGKILL once grace seconds have passed: (seconds, exit code,
        what preStop did)."""
        began = time.monotonic()
        said = ""
        if grace > 0 and pod.plan.pre_stop is not None:
            ok, said = self.act(pod, pod.plan.pre_stop, timeout=grace)
            said = ("passed" if ok else "failed") + f" ({said})"
        if grace <= 0:
            self.d("kill", pod.name, check=False)
        else:
            # The kubelet gives 2 s more when preStop used up the grace period.
            left = max(2, int(grace - (time.monotonic() - began) + 0.999))
            self.d("stop", "-t", str(left), pod.name, check=False, timeout=left + 60)
        code = self.d("inspect", "-f", "{{.State.ExitCode}}", pod.name, check=False).stdout.strip()
        return time.monotonic() - began, code, said

    def delete(self, name: str, grace: float | None = None) -> tuple[float, str, str]:
        """`kubectl delete pod NAME [--grace-period=N]` (0: `--force`, SIGKILL, no preStop); the Deployment
        creates the replacement at once. Returns the seconds the container took to stop, its exit code and
        what preStop did."""
        with self.lock:
            pod = self.pods[name]
            pod.deleting = True
        if self.replace:
            self.create(pod.deployment)
        took, code, said = self._stop(pod, pod.plan.grace_s if grace is None else grace)
        pod.exits.append(f"exit {code}")
        self.d("rm", "-f", pod.name, check=False)
        with self.lock:
            self.gone.append(self.pods.pop(name))
        shutil.rmtree(self.workdir / "pods" / name, ignore_errors=True)
        self.log(
            f"{pod.describe()}: deleted (stopped in {took:.1f}s, exit {code}"
            + (f", preStop {said}" if said else "")
            + ")"
        )
        return took, code, said

    def _restart(self, pod: Pod, reason: str) -> None:
        """Kill (with the grace period) and start again: a liveness or startup failure."""
        self._stop(pod, pod.plan.grace_s)
        pod.exits.append(f"{reason}: {self.last_log(pod)}")
        self._start_again(pod, reason)

    def _start_again(self, pod: Pod, reason: str) -> None:
        self.d("start", pod.name, check=False)
        pod.restarts += 1
        pod.reason = reason
        now = time.monotonic()
        pod.probes = ContainerProbes(pod.plan.probes, now)
        pod.restart_at = None
        self.log(f"{pod.describe()}: container restarted ({reason}; restart {pod.restarts})")

    # ------------------------------------------------------------------------------- the loop

    def _loop(self) -> None:
        while not self.stopping.wait(TICK_S):
            with self.lock:
                pods = [p for p in self.pods.values() if not p.deleting]
            try:
                states = self.states([p for p in pods if p.restart_at is None])
            except Exception:  # the engine is busy: ask again at the next tick
                continue
            for pod in pods:
                try:
                    self._tick(pod, *states.get(pod.name, (False, -1)))
                except Exception as e:  # one pod's trouble must not stop the others' probes
                    pod.reason = f"runner: {e.__class__.__name__}: {e}"

    def _tick(self, pod: Pod, running: bool, code: int) -> None:
        now = time.monotonic()
        if pod.restart_at is not None:
            if now >= pod.restart_at:
                self._start_again(pod, pod.reason)
            return
        if not running:
            if pod.deleting:
                return
            pod.exits.append(f"exit {code}: {self.last_log(pod)}")
            pod.ready_at = None
            delay = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** min(pod.restarts, 8))
            pod.reason, pod.restart_at = f"exited {code}", now + delay
            self.log(
                f"{pod.describe()}: container exited {code} ({pod.exits[-1]}); "
                f"restarting in {delay:.0f}s (restartPolicy Always)"
            )
            return
        for kind in pod.probes.due(now):
            spec = pod.plan.probes[kind]
            ok, said = self.act(pod, spec.action, timeout=spec.timeout)
            was_ready = pod.probes.ready
            if pod.probes.record(kind, ok, time.monotonic()) == "restart" and not pod.deleting:
                self.log(f"{pod.describe()}: {kind} probe failed {spec.failure_threshold} times ({said})")
                self._restart(pod, f"{kind} probe failed")
                return
            if pod.probes.ready and not was_ready:
                pod.ready_at = time.monotonic()
                self.log(
                    f"{pod.describe()}: ready {pod.ready_at - pod.created:.1f}s after it was created "
                    f"({kind} probe: {said})"
                )
            elif was_ready and not pod.probes.ready:
                pod.ready_at = None
                self.log(f"{pod.describe()}: not ready ({kind} probe: {said})")
        if pod.probes.ready and pod.ready_at is None:  # no readiness probe: ready once running
            pod.ready_at = time.monotonic()
            self.log(
                f"{pod.describe()}: ready {pod.ready_at - pod.created:.1f}s after it was created (running)"
            )

    def trouble(self) -> str:
        """The first pod (not deleted) whose container ended or restarted, named with its Deployment."""
        with self.lock:
            pods = [p for p in self.pods.values() if p.exits and not p.deleting]
        return f"{pods[0].describe()}: {pods[0].exits[-1]} (restarts {pods[0].restarts})" if pods else ""

    def wait_ready(
        self, deployment_name: str, count: int, timeout: float, only: list[str] | None = None
    ) -> list[Pod]:
        """Until `count` pods of the Deployment (or of `only`) are ready; a pod whose container ended first
        fails at once, naming its Deployment and what the container said last."""
        deadline = time.monotonic() + timeout
        while True:
            pods = [p for p in self.of(deployment_name) if only is None or p.name in only]
            for p in pods:
                if p.exits:
                    raise PodFailure(
                        f"{p.describe()}: container {p.plan.container} ended before it was ready: "
                        f"{p.exits[0]}"
                    )
            ready = [p for p in pods if p.ready_at is not None]
            if len(ready) >= count:
                return ready
            if time.monotonic() > deadline:
                names = ", ".join(f"{p.name} ({'ready' if p.ready_at else 'not ready'})" for p in pods)
                raise PodFailure(
                    f"Deployment/{deployment_name}: {len(ready)} of {count} pods ready after "
                    f"{timeout:.0f}s ({names or 'no pods'})"
                )
            time.sleep(TICK_S)

    # ------------------------------------------------------------------------------- teardown

    def down(self) -> list[str]:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
        gone = []
        ids = self.d("ps", "-aq", "--filter", f"label={self.label}", check=False).stdout.split()
        if ids:
            self.d("rm", "-f", *ids, check=False, timeout=120)
            gone.append(f"{len(ids)} containers")
        if self.network_made and self.d("network", "rm", self.network, check=False).returncode == 0:
            gone.append(f"network {self.network}")
        for v in sorted(self.claims):
            if self.d("volume", "rm", v, check=False).returncode == 0:
                gone.append(f"volume {v}")
        shutil.rmtree(self.workdir / "pods", ignore_errors=True)
        return gone


def write_files(plan: PodPlan) -> None:
    """The pod's env file (0600: Secret values stay off command lines) and its ConfigMap and Secret files
    (the volume's mode, group fsGroup as the kubelet sets it)."""
    plan.env_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(plan.env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{k}={v}\n" for k, v in plan.env.items())
    gid = plan.fs_group if plan.fs_group is not None else 0
    for path in plan.dirs:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o755)
    for path, (content, mode) in sorted(plan.files.items()):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o755)
        path.write_bytes(content)
        path.chmod(mode)
        with contextlib.suppress(PermissionError):
            os.chown(path, 0, gid)


__all__ = ["PodFailure", "Pod", "Runtime", "free_subnet", "ref"]
