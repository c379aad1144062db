"""The checkers of tests/test_k8s.py: what the Kubernetes and KubeRay manifests in k8s/ are (paths, the
project's version, the Secret, the claim, the reviewed checkov skips) and the functions that read them and
say what is wrong, each returning a list of problems (empty: nothing wrong): headers, tokens, pinned
interfaces, pod templates' lock-down, preemption numbers, kubernetes-validate, checkov and its skips.
The tests assert that a shipped manifest has no problem, and that a copy broken on purpose has the
expected one."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import tomllib
import yaml
from helpers import PY, REPO, tool

K8S = REPO / "k8s"
PLAIN = sorted(K8S.glob("*.yaml"))  # `kubectl apply -f k8s/` applies exactly these
RAYCLUSTER = K8S / "kuberay" / "raycluster.gpu.yaml"
RAYJOB = K8S / "kuberay" / "rayjob.train.yaml"
OVERLAY = K8S / "overlays" / "kind-cpu"
KIND_CLUSTER = K8S / "kind" / "cluster.yaml"
ALL_YAML = sorted(K8S.rglob("*.yaml"))

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]
CPU_IMAGE = f"trainapp:{VERSION}-cpu"  # the kind overlay's, loaded with `kind load docker-image`
# The Kubernetes version the manifests target (kubernetes-validate wants major.minor.patch).
K8S_VERSION = "1.32.0"
# API groups that are not core Kubernetes: kubernetes-validate has no schema for them.
NOT_CORE = {"ray.io", "kind.x-k8s.io", "kustomize.config.k8s.io", "monitoring.coreos.com"}
TOKEN_SECRET = {"name": "ray-auth-token", "key": "token"}
RUNS_CLAIM, RUNS_MOUNT = "trainapp-runs", "/mnt/runs"
# checkov checks skipped by `checkov.io/skipN: ID=reason` annotations on a resource. A new skip must be
# added here too, so that it is reviewed:
#   CKV_K8S_43 image digest: the image is built and pushed by its user (or loaded into kind);
#   CKV_K8S_35 secret as an env variable: Ray gets its token as RAY_AUTH_TOKEN from the Secret, as KubeRay
#              documents it (a mounted file and RAY_AUTH_TOKEN_PATH would avoid this skip);
#   CKV_K8S_40 uid >= 10000: the image's user is uid 1000, which owns the shared run files;
#   CKV_K8S_15 imagePullPolicy Always: the kind overlay's image is loaded, never pulled (Never).
ALLOWED_CHECKOV_SKIPS = {"CKV_K8S_15", "CKV_K8S_35", "CKV_K8S_40", "CKV_K8S_43"}
TOKEN_LIKE = re.compile(r"(?<![0-9A-Fa-f])[0-9A-Fa-f]{64}(?![0-9A-Fa-f])")
# Set in the environment, these win over trainapp's own `network.interface` (default auto: per node, the
# interface routing to the rendezvous address or Ray head). No shipped config may pin them; the
# manifests show them only commented out, as an example.
IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
PIN_SCANNED = sorted(p for d in (K8S, REPO / "ray_cluster") for p in d.rglob("*")
                     if p.suffix in (".yaml", ".yml"))
HEADER_KEYS = ("# Apply:", "# Check:", "# Logs:", "# Clean:")


# ------------------------------------------------------------------------------------- helpers


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def load(path: Path) -> dict:
    (doc,) = docs(path)
    return doc


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def group(obj: dict) -> str:
    """API group of an object ("" for the core group `v1`)."""
    api = obj["apiVersion"]
    return api.rpartition("/")[0]


def is_core(obj: dict) -> bool:
    return group(obj) not in NOT_CORE


def ray_pin() -> str:
    """The Ray of the images and the manifests: the newest of the supported range, which the driver
    accepts."""
    from trainapp.launch.ray import checks

    return checks.check_version(checks.NEWEST_TESTED)


def walk(node: Any):
    """Every (key, value) of nested dicts and lists."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield k, v
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def header_problems(path: Path) -> list[str]:
    """The comment block before the first YAML line must end with the Apply/Check/Logs/Clean lines,
    and the Apply line must name the file (or, for the overlay, its folder)."""
    header = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#"):
            header.append(line)
    if not header:
        return [f"{rel(path)}: no header comment"]
    missing = [key for key in HEADER_KEYS if not any(line.startswith(key) for line in header)]
    if missing:
        return [f"{rel(path)}: the header lacks {missing}"]
    last = header[-len(HEADER_KEYS):]
    if not all(line.startswith(key) for line, key in zip(last, HEADER_KEYS)):
        return [f"{rel(path)}: the header should end with the lines {HEADER_KEYS}, in that order"]
    if rel(path) not in last[0] and rel(path.parent) not in last[0]:
        return [f"{rel(path)}: the Apply line does not name the file: {last[0]}"]
    return []


def interface_pins(paths: list[Path], names: tuple[str, ...] = IFNAME_VARS) -> list[str]:
    """Uncommented lines that mention one of `names` (default NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), in
    any form (a ConfigMap or runtime-env key, an env entry's name, a `-e NAME=value` run option)."""
    found = []
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = re.sub(r"(^|\s)#.*", "", line)  # YAML comments, also inside block scalars
            found += [f"{rel(path)}:{n}: sets {var}: {line.strip()}" for var in names if var in code]
    return found


def token_problems(root: Path) -> list[str]:
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if TOKEN_LIKE.search(line):
                found.append(f"{path.relative_to(root)}:{n}: a 64-hex-digit string (a token?)")
    for path in sorted(root.rglob("*.yaml")):
        found += [f"{path.relative_to(root)}: a Secret object (the token Secret is created, not committed)"
                  for d in docs(path) if d.get("kind") == "Secret"]
    return found


# ------------------------------------------------------------------------------------- pod templates


@dataclass
class Pod:
    where: str  # file: Kind/name[/group]
    role: str | None  # head, worker, submitter
    spec: dict


def cluster_pods(spec: dict, where: str) -> list[Pod]:
    """The head and worker group pod templates of a RayCluster spec."""
    pods = [Pod(f"{where}/head", "head", spec["headGroupSpec"]["template"]["spec"])]
    pods += [Pod(f"{where}/{g['groupName']}", "worker", g["template"]["spec"])
             for g in spec["workerGroupSpecs"]]
    return pods


def pods_of(objs: list[dict], source: str) -> list[Pod]:
    pods = []
    for obj in objs:
        kind, name = obj["kind"], obj["metadata"]["name"]
        where = f"{source}:{kind}/{name}"
        if kind == "Deployment":
            tpl = obj["spec"]["template"]
            component = tpl["metadata"].get("labels", {}).get("app.kubernetes.io/component")
            pods.append(Pod(where, {"ray-head": "head", "ray-worker": "worker"}.get(component), tpl["spec"]))
        elif kind == "RayCluster":
            pods += cluster_pods(obj["spec"], where)
        elif kind == "RayJob":
            pods += cluster_pods(obj["spec"]["rayClusterSpec"], where)
            pods.append(Pod(f"{where}/submitter", "submitter", obj["spec"]["submitterPodTemplate"]["spec"]))
    return pods


def pod_problems(pod: Pod) -> list[str]:
    """What a pod template lacks. Every container here is a Ray container (head, worker, or the job
    submitter that runs `ray job submit`), so each one needs the token."""
    spec, problems = pod.spec, []
    say = lambda msg: problems.append(f"{pod.where}: {msg}")  # noqa: E731
    if pod.role not in ("head", "worker", "submitter"):
        say("unknown role (label app.kubernetes.io/component should be ray-head or ray-worker)")
    psc = spec.get("securityContext") or {}
    if psc.get("runAsNonRoot") is not True:
        say("pod securityContext.runAsNonRoot is not true")
    if (psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        say("pod securityContext.seccompProfile.type is not RuntimeDefault")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for c in spec.get("initContainers", []) + spec["containers"]:
        name = c["name"]
        csc = c.get("securityContext") or {}
        if csc.get("allowPrivilegeEscalation") is not False:
            say(f"{name}: securityContext.allowPrivilegeEscalation is not false")
        if "ALL" not in (csc.get("capabilities") or {}).get("drop", []):
            say(f"{name}: securityContext.capabilities.drop lacks ALL")
        resources = c.get("resources") or {}
        for part in ("requests", "limits"):
            missing = {"cpu", "memory"} - set(resources.get(part) or {})
            if missing:
                say(f"{name}: resources.{part} lacks {sorted(missing)}")
    for c in spec["containers"]:
        name = c["name"]
        env = {e["name"]: e for e in c.get("env", [])}
        if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
            say(f"{name}: RAY_AUTH_MODE is not `token`")
        ref = (env.get("RAY_AUTH_TOKEN", {}).get("valueFrom") or {}).get("secretKeyRef") or {}
        if {k: ref.get(k) for k in TOKEN_SECRET} != TOKEN_SECRET or "value" in env.get("RAY_AUTH_TOKEN", {}):
            say(f"{name}: RAY_AUTH_TOKEN does not come from secretKeyRef {TOKEN_SECRET}")
    if pod.role in ("head", "worker"):
        ray = spec["containers"][0]  # KubeRay's rule: the first container is the Ray container
        ports = {p.get("name") for p in ray.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe"):
            if probe not in ray:
                say(f"{ray['name']}: no {probe}")
            elif "tcpSocket" in ray[probe] and ray[probe]["tcpSocket"]["port"] not in ports:
                say(f"{ray['name']}: {probe} port {ray[probe]['tcpSocket']['port']} is not a named port")
        mounts = {m["mountPath"]: m["name"] for m in ray.get("volumeMounts", [])}
        shm = volumes.get(mounts.get("/dev/shm"), {})
        if (shm.get("emptyDir") or {}).get("medium") != "Memory":
            say(f"{ray['name']}: /dev/shm is not an emptyDir with medium Memory")
        runs = volumes.get(mounts.get(RUNS_MOUNT), {})
        if (runs.get("persistentVolumeClaim") or {}).get("claimName") != RUNS_CLAIM:
            say(f"{ray['name']}: the claim {RUNS_CLAIM} is not mounted at {RUNS_MOUNT}")
    return problems


STATIC_PODS = pods_of([d for p in PLAIN for d in docs(p)], "k8s") + \
    pods_of(docs(RAYCLUSTER), RAYCLUSTER.name) + pods_of(docs(RAYJOB), RAYJOB.name)
WORKER_PODS = [p for p in STATIC_PODS if p.role == "worker"]


# ------------------------------------------------------------------------------------- preemption

# Deleting a worker pod is a preemption notice. The preStop `trainapp drain --wait-s W --ray-deadline-s D`
# must outwait the training processes' own deadline (W > preempt.grace_s), leave Ray time to stop inside
# the pod's grace period (W + RAY_STOP_S <= terminationGracePeriodSeconds; the hook's time counts against
# it), and give Ray the grace period as the drain deadline (D == terminationGracePeriodSeconds).
RAY_STOP_S = 10
DRAIN_FLAGS = ("--wait-s", "--ray-deadline-s")


def trainapp_call(words: list[str]) -> tuple[str, dict[str, list[str]], list[str]] | None:
    """(subcommand, {flag: [values]}, command after `--`) of `python -m trainapp SUB [--flag V ...] [-- ...]`;
    None if `words` is no such call."""
    if len(words) < 4 or not Path(words[0]).name.startswith("python") or words[1:3] != ["-m", "trainapp"]:
        return None
    rest = words[4:]
    opts, after = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    flags: dict[str, list[str]] = {}
    it = iter(opts)
    for w in it:
        name, eq, value = w.partition("=")
        flags.setdefault(name, []).append(value if eq else next(it, ""))
    return words[3], flags, after


def drain_numbers(words: list[str], what: str, say: Callable[[str], None]) -> dict[str, float]:
    """--wait-s and --ray-deadline-s of a `trainapp drain|node` call, each given exactly once, and the
    call accepted by trainapp's own parser."""
    from trainapp.cli import _parser

    try:
        _parser().parse_args(words[3:])
    except SystemExit:
        say(f"{what}: trainapp's parser rejects {words[3:]}")
    _, flags, _ = trainapp_call(words)
    numbers = {}
    for flag in DRAIN_FLAGS:
        values = flags.get(flag, [])
        if len(values) != 1:
            say(f"{what}: {flag} given {len(values)} times (must be set once, explicitly)")
            continue
        try:
            numbers[flag] = float(values[0])
        except ValueError:
            say(f"{what}: {flag} {values[0]!r} is not a number")
    return numbers


def config_grace_s(config_yaml: str, overrides: list[str] = ()) -> float:
    """preempt.grace_s of a trainapp config file plus `KEY=VALUE` overrides (trainapp's default if unset)."""
    for o in overrides:
        if o.startswith("preempt.grace_s="):
            return float(o.partition("=")[2])
    preempt = (yaml.safe_load(config_yaml) or {}).get("preempt") or {}
    if "grace_s" in preempt:
        return float(preempt["grace_s"])
    from trainapp.config import PreemptSection

    return PreemptSection().grace_s


def preemption_problems(pod: Pod, grace_s: float) -> list[str]:
    """What keeps deleting this worker pod from being a clean preemption: see RAY_STOP_S above. A
    container that sets its own command (not KubeRay, which writes `ray start` itself) must run it
    under `trainapp node` with the preStop's numbers, so a SIGTERM without the hook still drains."""
    problems: list[str] = []
    say = lambda msg: problems.append(f"{pod.where}: {msg}")  # noqa: E731
    ray = pod.spec["containers"][0]  # KubeRay's rule: the first container is the Ray container
    grace_period = pod.spec.get("terminationGracePeriodSeconds")
    if grace_period is None:
        say("no terminationGracePeriodSeconds (Kubernetes' default 30 cuts the drain short)")
    pre = (((ray.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command") or []
    call = trainapp_call(pre)
    if call is None or call[0] != "drain":
        say(f"{ray['name']}: preStop does not run `python -m trainapp drain`: {pre}")
        return problems
    drain = drain_numbers(pre, "preStop", say)
    wait, deadline = drain.get("--wait-s"), drain.get("--ray-deadline-s")
    if wait is not None and not wait > grace_s:
        say(f"preStop --wait-s {wait:g} is not above preempt.grace_s {grace_s:g} "
            f"(the snapshot may not be done)")
    if wait is not None and grace_period is not None and not wait + RAY_STOP_S <= grace_period:
        say(f"preStop --wait-s {wait:g} + {RAY_STOP_S} s for Ray exceeds terminationGracePeriodSeconds "
            f"{grace_period}")
    if deadline is not None and grace_period is not None and deadline != grace_period:
        say(f"preStop --ray-deadline-s {deadline:g} is not terminationGracePeriodSeconds {grace_period}")
    command = [str(w) for w in ray.get("command", []) + ray.get("args", [])]
    if command:
        node = trainapp_call(command)
        if node is None or node[0] != "node":
            say(f"{ray['name']}: the command is not wrapped in `python -m trainapp node ... --`: "
                f"{command[:6]}")
        else:
            numbers = drain_numbers(command, "trainapp node", say)
            for flag in DRAIN_FLAGS:
                if flag in numbers and flag in drain and numbers[flag] != drain[flag]:
                    say(f"trainapp node {flag} {numbers[flag]:g} differs from the preStop's {drain[flag]:g}")
            if node[2][:2] != ["ray", "start"] or "--block" not in node[2]:
                say(f"trainapp node does not run `ray start ... --block`: {node[2]}")
    return problems


def rayjob_overrides() -> list[str]:
    """The entrypoint's KEY=VALUE overrides after `--config FILE`."""
    words = shlex.split(load(RAYJOB)["spec"]["entrypoint"])
    return words[words.index("--config") + 2:]


# ------------------------------------------------------------------------------------- tools


def kubernetes_validate_problems(paths: list[Path]) -> list[str]:
    """Run kubernetes-validate --strict once over `paths`; every core object must be reported `passed`
    (an unknown kind only warns and exits 0, so the exit code alone proves nothing)."""
    exe = tool("kubernetes-validate")
    r = subprocess.run([str(exe), "--strict", "-k", K8S_VERSION, *map(str, paths)],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    passed = set(re.findall(r" (\S+) passed for resource ([\w.-]+)/([\w.-]+) against", out))
    problems = [line for line in out.splitlines() if not re.match(r"INFO .* passed for resource", line)]
    for path in paths:
        for d in docs(path):
            if is_core(d) and (str(path), d["kind"].lower(), d["metadata"]["name"]) not in passed:
                problems.append(f"{rel(path)}: {d['kind']}/{d['metadata']['name']} was not validated")
    if r.returncode != 0:
        problems.append(f"kubernetes-validate exit {r.returncode}")
    return problems


def run_checkov(*target: str) -> tuple[int, list[dict], str]:
    exe = tool("checkov")
    r = subprocess.run([str(exe), *target, "--framework", "kubernetes", "--compact", "-o", "json",
                        "--skip-download"], cwd=REPO, capture_output=True, text=True, timeout=300)
    try:
        out = json.loads(r.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"checkov printed no JSON (exit {r.returncode}): "
                             f"{r.stdout[-1500:]}{r.stderr[-1500:]}")
    return r.returncode, out if isinstance(out, list) else [out], r.stderr


def checkov_problems(result: tuple[int, list[dict], str], expect: set[str]) -> list[str]:
    """Failed checks, parsing errors, unreviewed or unexplained skips, and expected resources that
    no check looked at (checkov ids: Kind.namespace.name[.labels])."""
    rc, reports, stderr = result
    problems, checked = [], set()
    for rep in reports:  # with no resource at all, checkov prints a bare summary
        results, summary = rep.get("results", {}), rep.get("summary", rep)
        if rep.get("check_type", "kubernetes") != "kubernetes":
            problems.append(f"unexpected check type {rep.get('check_type')}")
        for c in results.get("failed_checks", []):
            problems.append(f"FAILED {c['check_id']} ({c['check_name']}) on {c['resource']} "
                            f"in {c['file_path']}")
        if summary.get("parsing_errors"):
            problems.append(f"parsing errors: {results.get('parsing_errors')}")
        for c in results.get("skipped_checks", []):
            reason = ((c.get("check_result") or {}).get("suppress_comment") or "").strip()
            if c["check_id"] not in ALLOWED_CHECKOV_SKIPS or not reason:
                problems.append(f"skip of {c['check_id']} on {c['resource']}: not reviewed or no reason")
        checked |= {c["resource"] for c in results.get("passed_checks", [])}
    for want in sorted(expect):
        if not any(r == want or r.startswith(want + ".") for r in checked):
            problems.append(f"no check passed on {want}: was it scanned?")
    if rc != 0 and not problems:
        problems.append(f"checkov exit {rc}: {stderr[-1500:]}")
    return problems


def kuberay_as_core_objects() -> list[dict]:
    """The RayCluster's and RayJob's pod templates as the objects KubeRay makes of them (Pods for the
    head and worker groups, a Job for the submitter), each with the annotations (checkov skips) of its
    custom resource; plus the NetworkPolicy, which checkov's CKV2_K8S_6 looks for beside the pods."""
    out = [load(K8S / "networkpolicy.ray.yaml")]
    for cr in (load(RAYCLUSTER), load(RAYJOB)):
        meta = cr["metadata"]
        spec = cr["spec"] if cr["kind"] == "RayCluster" else cr["spec"]["rayClusterSpec"]
        templates = [("head", spec["headGroupSpec"]["template"])]
        templates += [(f"worker-{g['groupName']}", g["template"]) for g in spec["workerGroupSpecs"]]
        for suffix, tpl in templates:
            out.append({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": f"{meta['name']}-{suffix}", "namespace": meta["namespace"],
                                     "labels": tpl["metadata"].get("labels", {}),
                                     "annotations": meta.get("annotations", {})},
                        "spec": tpl["spec"]})
        if cr["kind"] == "RayJob":
            out.append({"apiVersion": "batch/v1", "kind": "Job",
                        "metadata": {"name": f"{meta['name']}-submitter", "namespace": meta["namespace"],
                                     "annotations": meta.get("annotations", {})},
                        "spec": {"template": cr["spec"]["submitterPodTemplate"]}})
    return out


def skip_entries(objs: list[dict], where: str) -> list[tuple[str, str, str]]:
    """(where, annotation, value) of every checkov.io/skip* annotation in `objs`, including those a
    Kustomization's JSON patches add or replace."""
    found = []
    for obj in objs:
        name = f"{where}:{obj.get('kind')}/{(obj.get('metadata') or {}).get('name', '')}"
        found += [(name, k, v) for k, v in walk(obj)
                  if isinstance(k, str) and k.startswith("checkov.io/skip")]
        for patch in obj.get("patches", []) if obj.get("kind") == "Kustomization" else []:
            target = (f"{where}:patch of {patch.get('target', {}).get('kind')}/"
                      f"{patch.get('target', {}).get('name')}")
            for op in yaml.safe_load(patch.get("patch", "")) or []:
                key = op.get("path", "").rpartition("/")[2].replace("~1", "/")
                if key.startswith("checkov.io/skip"):
                    found.append((target, key, op.get("value")))
    return found


def skip_problems(entries: list[tuple[str, str, str]]) -> list[str]:
    problems = []
    for where, key, value in entries:
        m = re.fullmatch(r"(CKV2?_K8S_\d+)=(.*)", str(value or ""), re.S)
        if not re.fullmatch(r"checkov\.io/skip\d+", key) or not m:
            problems.append(f"{where}: {key}: {value!r} is not `checkov.io/skipN: CKV_K8S_NN=reason`")
        elif len(m.group(2).strip()) < 15:
            problems.append(f"{where}: {key}: skip of {m.group(1)} without a reason")
        elif m.group(1) not in ALLOWED_CHECKOV_SKIPS:
            problems.append(f"{where}: {key}: {m.group(1)} is not in ALLOWED_CHECKOV_SKIPS "
                            f"(review it, then add it)")
    return problems


def resolved_config(config_yaml: str, overrides: list[str], tmp: Path) -> dict:
    """trainapp's own resolution of a config file plus overrides (`python -m trainapp config`)."""
    path = tmp / "config.yaml"
    path.write_text(config_yaml)
    r = subprocess.run([PY, "-m", "trainapp", "config", "--config", str(path), *overrides],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return yaml.safe_load(r.stdout)


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def elastic_range(entrypoint: str) -> tuple[int, int]:
    words = shlex.split(entrypoint)
    values = [w.partition("=")[2] for w in words if w.startswith("ray.num_workers=")]
    assert len(values) == 1, f"one ray.num_workers=[min,max] in the entrypoint: {entrypoint}"
    lo, hi = yaml.safe_load(values[0])
    return lo, hi
