"""What a schema cannot see, checked before any container starts; each problem is one line naming the
manifest, the object, the field and what is wrong:

- `python -m MODULE` (a command, its args, a probe or hook, the job's entrypoint) names a module the image
  has;
- `NAME:PORT` in an argument or an env value names a Service of the namespace with that port;
- `--config PATH` lies in a volume that provides the file (a ConfigMap or Secret key) or in the image;
- a run's storage (`ray.storage_path=`, `run.dir=`) is on a claim mounted by every Ray pod, head and
  workers alike, since the head's driver reads what the workers write.

The same breakages also fail at run time (a container that exits, a worker that never joins, a job
that fails), later and less plainly; the smoke runs one such case for real (scripts/container_smoke.py).
"""

from __future__ import annotations

import contextlib
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from .manifests import ManifestError, Objects, namespace_of, ref
from .podspec import selects

HOST_PORT = re.compile(r"^(?:--[\w-]+=)?(?:[a-z]+://)?([a-z][a-z0-9-]*(?:\.[a-z0-9-]+)*):(\d+)(?:/.*)?$")
STORAGE_KEYS = ("ray.storage_path", "run.dir")


@dataclass
class Job:
    """A job the smoke submits: its entrypoint and where it comes from."""

    entrypoint: str
    source: str  # e.g. "k8s/kuberay/rayjob.train.yaml spec.entrypoint"


def python_modules(argv: list[str]) -> list[str]:
    """MODULE of every `python[3[.X]] -m MODULE` in argv."""
    return [
        argv[i + 2]
        for i, a in enumerate(argv[:-2])
        if re.fullmatch(r"(?:.*/)?python(?:3(?:\.\d+)?)?", a) and argv[i + 1] == "-m"
    ]


def config_paths(argv: list[str]) -> list[str]:
    out = []
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith("--config="):
            out.append(a.split("=", 1)[1])
    return out


def storage_paths(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] in STORAGE_KEYS and "=" in a]


def words(argv: list[str]) -> list[str]:
    """argv, and the words of a shell script in it (`bash -c "...; ray start ..."`, as KubeRay writes)."""
    out = list(argv)
    shells = [i for i, a in enumerate(argv) if re.fullmatch(r"(?:.*/)?(?:ba)?sh", a)]
    if shells and any(a.startswith("-") and "c" in a for a in argv[shells[0] + 1:shells[0] + 3]):
        for script in argv[shells[0] + 2:]:
            with contextlib.suppress(ValueError):
                out += [w.rstrip(";") for w in shlex.split(script.replace(";", " ; ").replace("&&", " && "))]
    return out


def argvs(container: dict) -> dict[str, list[str]]:
    """Every command line of a container, by the field it is in (a shell script's words included)."""
    argv = [str(x) for x in (container.get("command") or []) + (container.get("args") or [])]
    out = {"command": words(argv)}
    for kind in ("liveness", "readiness", "startup"):
        cmd = ((container.get(f"{kind}Probe") or {}).get("exec") or {}).get("command")
        if cmd:
            out[f"{kind}Probe.exec.command"] = words([str(x) for x in cmd])
    for hook in ("preStop", "postStart"):
        cmd = (((container.get("lifecycle") or {}).get(hook) or {}).get("exec") or {}).get("command")
        if cmd:
            out[f"lifecycle.{hook}.exec.command"] = words([str(x) for x in cmd])
    return out


def mount_for(path: str, container: dict, volumes: dict[str, dict]) -> tuple[dict, dict] | None:
    """The volume mount over a path in the container (the deepest mountPath), and its volume."""
    best = None
    for m in container.get("volumeMounts") or []:
        mp = m["mountPath"].rstrip("/") or "/"
        if (path == mp or path.startswith(mp + "/")) and (
            best is None or len(mp) > len(best[0]["mountPath"])
        ):
            best = (m, volumes.get(m["name"], {}))
    return best


def provides(path: str, mount: dict, volume: dict, objects: Objects, namespace: str) -> bool:
    """Whether the ConfigMap/Secret volume mounted at mount holds the file path."""
    kind = "ConfigMap" if "configMap" in volume else "Secret" if "secret" in volume else ""
    if not kind:
        return True  # an emptyDir or a claim: written at run time
    body = volume["configMap"] if kind == "ConfigMap" else volume["secret"]
    data = (
        objects.data(kind, body.get("name") if kind == "ConfigMap" else body.get("secretName"), namespace)
        or {}
    )
    files = (
        [it["path"] for it in body.get("items") or [] if it["key"] in data]
        if body.get("items")
        else list(data)
    )
    rel = path[len(mount["mountPath"].rstrip("/")) :].lstrip("/")
    if mount.get("subPath"):
        return rel == "" and mount["subPath"] in files
    return rel in files


def is_ray_pod(container: dict) -> bool:
    argv = argvs(container)["command"]
    return any(a.rsplit("/", 1)[-1] == "ray" and b == "start" for a, b in zip(argv, argv[1:]))


def is_head(container: dict) -> bool:
    return is_ray_pod(container) and "--head" in argvs(container)["command"]


def check(
    objects: Objects,
    *,
    module_exists: Callable[[str], bool],
    file_in_image: Callable[[str], bool],
    jobs: list[Job] = (),
) -> None:
    """Raise ManifestError for the first problem found (its line says how many more there are)."""
    problems: list[str] = []
    deployments = objects.of_kind("Deployment")
    for dep in deployments:
        head = f"{objects.source(dep)} {ref(dep)}"
        ns = namespace_of(dep)
        spec = dep["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        services = {
            s["metadata"]["name"]: {int(p["port"]) for p in s["spec"].get("ports") or []}
            for s in objects.of_kind("Service", ns)
        }
        for ci, c in enumerate(spec.get("containers") or []):
            cp = f"spec.template.spec.containers[{ci}]"
            for field, argv in argvs(c).items():
                for mod in python_modules(argv):
                    if not module_exists(mod):
                        problems.append(
                            f"{head}: {cp}.{field}: `python -m {mod}`: the image has no module {mod!r}"
                        )
                for path in config_paths(argv):
                    problems += check_path(
                        path, c, volumes, objects, ns, file_in_image, f"{head}: {cp}.{field}"
                    )
            values = argvs(c)["command"] + [str(e.get("value", "")) for e in c.get("env") or []]
            for v in values:
                m = HOST_PORT.match(v)
                if not m or m.group(1) == "localhost":
                    continue
                name, _, rest = m.group(1).partition(".")
                other_ns = rest.split(".")[0] if rest else ns
                port = int(m.group(2))
                if other_ns != ns:
                    continue  # another namespace's Service: not in the rendered set
                if name not in services:
                    problems.append(
                        f"{head}: {cp}: {v!r} names no Service of namespace {ns} "
                        f"(Services: {', '.join(sorted(services)) or 'none'})"
                    )
                elif port not in services[name]:
                    problems.append(
                        f"{head}: {cp}: {v!r}: Service {name} has no port {port} "
                        f"(ports: {', '.join(map(str, sorted(services[name])))})"
                    )
    for svc in objects.of_kind("Service"):
        selector = svc["spec"].get("selector") or {}
        templates = [d["spec"]["template"].get("metadata", {}).get("labels") or {} for d in deployments
                     if namespace_of(d) == namespace_of(svc)]
        if selector and not any(selects(svc, t) for t in templates):
            problems.append(f"{objects.source(svc)} {ref(svc)}: spec.selector {selector} selects no pod of "
                            "any Deployment: its name would resolve to nothing")
    ray = [(d, c) for d in deployments for c in d["spec"]["template"]["spec"]["containers"] if is_ray_pod(c)]
    heads = [(d, c) for d, c in ray if is_head(c)]
    for job in jobs:
        argv = shlex.split(job.entrypoint)
        for mod in python_modules(argv):
            if not module_exists(mod):
                problems.append(f"{job.source}: `python -m {mod}`: the image has no module {mod!r}")
        if not heads:
            problems.append(f"{job.source}: no Deployment runs a Ray head (`ray start --head`) for the job")
            continue
        dep, c = heads[0]
        ns = namespace_of(dep)
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"].get("volumes") or []}
        for path in config_paths(argv):
            problems += check_path(
                path,
                c,
                volumes,
                objects,
                ns,
                file_in_image,
                f"{job.source} (run on the head, {objects.source(dep)} {ref(dep)})",
            )
        for path in storage_paths(argv):
            for d, rc in ray:
                vols = {v["name"]: v for v in d["spec"]["template"]["spec"].get("volumes") or []}
                found = mount_for(path, rc, vols)
                if found is None or "persistentVolumeClaim" not in found[1]:
                    problems.append(
                        f"{job.source}: storage {path} is not on a claim mounted by "
                        f"{objects.source(d)} {ref(d)} (its mounts: "
                        f"{', '.join(m['mountPath'] for m in rc.get('volumeMounts') or []) or 'none'}); "
                        "every Ray pod must see the run's directory"
                    )
    if problems:
        more = f" ({len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise ManifestError(problems[0] + more)


def check_path(
    path: str,
    container: dict,
    volumes: dict[str, dict],
    objects: Objects,
    ns: str,
    file_in_image: Callable[[str], bool],
    head: str,
) -> list[str]:
    found = mount_for(path, container, volumes)
    if found is None:
        if file_in_image(path):
            return []
        mounts = ", ".join(m["mountPath"] for m in container.get("volumeMounts") or []) or "none"
        return [f"{head}: --config {path} is in no volume of the pod (mounts: {mounts}) and not in the image"]
    mount, volume = found
    if provides(path, mount, volume, objects, ns):
        return []
    return [
        f"{head}: --config {path}: the volume {mount['name']!r} mounted at {mount['mountPath']} "
        "has no such file"
    ]
