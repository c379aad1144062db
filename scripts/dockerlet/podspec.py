"""A Deployment's pod template to the arguments of `docker create`, as a kubelet would run it.

Pure: no Docker is needed, so every translation is unit-tested (tests/test_dockerlet.py). The fields
below are the ones implemented; any other field of a pod template stops the runner with one line naming
the manifest, the object and the field's path, so the manifests cannot grow untested parts silently.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .manifests import ManifestError, Objects, namespace_of, ref

LEAF = None  # a field taken as it is (its value is checked in translate where it matters)
NAME_OPT = {"name": LEAF, "optional": LEAF}
HTTP_GET = {"path": LEAF, "port": LEAF, "scheme": LEAF, "httpHeaders": [{"name": LEAF, "value": LEAF}]}
HANDLER = {"exec": {"command": LEAF}, "httpGet": HTTP_GET, "sleep": {"seconds": LEAF}}
PROBE = {
    "exec": {"command": LEAF},
    "httpGet": HTTP_GET,
    "tcpSocket": {"port": LEAF},
    "initialDelaySeconds": LEAF,
    "periodSeconds": LEAF,
    "timeoutSeconds": LEAF,
    "successThreshold": LEAF,
    "failureThreshold": LEAF,
}
KEY_REF = {"name": LEAF, "key": LEAF, "optional": LEAF}
CONTAINER = {
    "name": LEAF,
    "image": LEAF,
    "imagePullPolicy": LEAF,
    "command": LEAF,
    "args": LEAF,
    "workingDir": LEAF,
    "env": [
        {
            "name": LEAF,
            "value": LEAF,
            "valueFrom": {
                "secretKeyRef": KEY_REF,
                "configMapKeyRef": KEY_REF,
                "fieldRef": {"fieldPath": LEAF, "apiVersion": LEAF},
            },
        }
    ],
    "envFrom": [{"configMapRef": NAME_OPT, "secretRef": NAME_OPT, "prefix": LEAF}],
    "ports": [{"containerPort": LEAF, "name": LEAF, "protocol": LEAF}],
    "volumeMounts": [{"name": LEAF, "mountPath": LEAF, "readOnly": LEAF, "subPath": LEAF}],
    "securityContext": {
        "runAsUser": LEAF,
        "runAsGroup": LEAF,
        "runAsNonRoot": LEAF,
        "readOnlyRootFilesystem": LEAF,
        "allowPrivilegeEscalation": LEAF,
        "privileged": LEAF,
        "capabilities": {"drop": LEAF, "add": LEAF},
        "seccompProfile": {"type": LEAF},
    },
    "resources": {"limits": {"cpu": LEAF, "memory": LEAF}, "requests": {"cpu": LEAF, "memory": LEAF}},
    "livenessProbe": PROBE,
    "readinessProbe": PROBE,
    "startupProbe": PROBE,
    "lifecycle": {"preStop": HANDLER, "postStart": HANDLER},
    "terminationMessagePath": LEAF,
    "terminationMessagePolicy": LEAF,
}
ITEMS = [{"key": LEAF, "path": LEAF, "mode": LEAF}]
POD_SPEC = {
    "containers": [CONTAINER],
    # Run to completion, one after the other, before the container: on the pod's IP, its volumes.
    "initContainers": [{k: v for k, v in CONTAINER.items() if not k.endswith("Probe") and k != "lifecycle"}],
    "volumes": [
        {
            "name": LEAF,
            "emptyDir": {"medium": LEAF, "sizeLimit": LEAF},
            "configMap": {"name": LEAF, "items": ITEMS, "defaultMode": LEAF, "optional": LEAF},
            "secret": {"secretName": LEAF, "items": ITEMS, "defaultMode": LEAF, "optional": LEAF},
            "persistentVolumeClaim": {"claimName": LEAF, "readOnly": LEAF},
        }
    ],
    "securityContext": {
        "runAsUser": LEAF,
        "runAsGroup": LEAF,
        "runAsNonRoot": LEAF,
        "fsGroup": LEAF,
        "fsGroupChangePolicy": LEAF,
        "supplementalGroups": LEAF,
        "seccompProfile": {"type": LEAF},
    },
    "terminationGracePeriodSeconds": LEAF,
    "serviceAccountName": LEAF,
    "serviceAccount": LEAF,
    "automountServiceAccountToken": LEAF,
    "restartPolicy": LEAF,
    "dnsPolicy": LEAF,
    "enableServiceLinks": LEAF,
}
OBJECT = {
    "apiVersion": LEAF,
    "kind": LEAF,
    "metadata": {"name": LEAF, "namespace": LEAF, "labels": LEAF, "annotations": LEAF},
}
DEPLOYMENT = {
    **OBJECT,
    "spec": {
        "replicas": LEAF,
        "selector": {"matchLabels": LEAF},
        # Only an update of the template uses the strategy; the runner never updates one.
        "strategy": {"type": LEAF, "rollingUpdate": {"maxSurge": LEAF, "maxUnavailable": LEAF}},
        "revisionHistoryLimit": LEAF,
        "progressDeadlineSeconds": LEAF,
        "template": {"metadata": {"labels": LEAF, "annotations": LEAF}, "spec": POD_SPEC},
    },
}
SERVICE = {
    **OBJECT,
    "spec": {
        "type": LEAF,
        "selector": LEAF,
        "clusterIP": LEAF,
        "ports": [{"name": LEAF, "port": LEAF, "targetPort": LEAF, "protocol": LEAF}],
    },
}
FIELD_REFS = (
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "status.podIP",
    "status.podIPs",
    "status.hostIP",
    "spec.nodeName",
    "spec.serviceAccountName",
)
NODE = "dockerlet"  # spec.nodeName of every pod: one host


def unsupported(obj: object, schema: object, path: str) -> list[str]:
    """Paths of the fields of obj that schema does not list."""
    if schema is LEAF:
        return []
    if isinstance(schema, list):
        if not isinstance(obj, list):
            return [path] if obj is not None else []
        return [p for i, item in enumerate(obj) for p in unsupported(item, schema[0], f"{path}[{i}]")]
    if not isinstance(obj, dict) or not isinstance(schema, dict):
        return []
    out = []
    for key, value in obj.items():
        sub = f"{path}.{key}" if path else key
        out += [sub] if key not in schema else unsupported(value, schema[key], sub)
    return out


class Where:
    """Builds the one-line errors about one object of one manifest."""

    def __init__(self, objects: Objects, obj: dict):
        self.head = f"{objects.source(obj)} {ref(obj)}"

    def error(self, path: str, why: str) -> ManifestError:
        return ManifestError(f"{self.head}: {path}: {why}")

    def refuse(self, paths: list[str]) -> None:
        if paths:
            more = f" ({len(paths) - 1} more such field(s))" if len(paths) > 1 else ""
            raise ManifestError(
                f"{self.head}: {paths[0]} is not implemented by the container smoke's pod runner "
                f"(scripts/dockerlet/podspec.py): remove it, or implement and test it there{more}"
            )


def check_fields(objects: Objects) -> None:
    """Every Deployment and Service uses only fields the runner implements."""
    for obj in objects.of_kind("Deployment"):
        Where(objects, obj).refuse(unsupported(obj, DEPLOYMENT, ""))
    for obj in objects.of_kind("Service"):
        Where(objects, obj).refuse(unsupported(obj, SERVICE, ""))


# ------------------------------------------------------------------------------------------ quantities

UNITS = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "": 1,
}


def cpu(value: object) -> float:
    """A CPU quantity ("2", "500m", 0.5) in cores."""
    s = str(value)
    return int(s[:-1]) / 1000 if s.endswith("m") else float(s)


def memory(value: object) -> int:
    """A memory quantity ("3Gi", "512Mi", "1e9", 1000) in bytes."""
    m = re.fullmatch(r"([0-9.eE+]+?)(Ki|Mi|Gi|Ti|k|K|M|G|T|)", str(value))
    if not m:
        raise ValueError(value)
    return int(float(m.group(1)) * UNITS[m.group(2)])


# ---------------------------------------------------------------------------------------------- plans


@dataclass
class Action:
    """A probe's or a lifecycle hook's action."""

    kind: str  # exec, http, tcp, sleep
    command: list[str] = field(default_factory=list)
    port: int = 0
    path: str = "/"
    scheme: str = "HTTP"
    headers: dict[str, str] = field(default_factory=dict)
    seconds: float = 0


@dataclass
class ProbeSpec:
    action: Action
    initial_delay: float = 0
    period: float = 10
    timeout: float = 1
    success_threshold: int = 1
    failure_threshold: int = 3


@dataclass
class PodPlan:
    """One pod of a Deployment, ready for `docker create`."""

    name: str
    namespace: str
    owner: str  # Deployment/NAME as rendered
    source: str  # the file under k8s/ that defines it
    ip: str
    labels: dict[str, str]
    container: str
    image: str
    create_args: list[str]  # `docker create` arguments after the container's name
    env: dict[str, str]  # written to the env file (values stay off command lines)
    env_file: Path
    files: dict[Path, tuple[bytes, int]]  # ConfigMap and Secret files: host path -> (content, mode)
    dirs: list[Path]  # their volumes' directories, made even when a volume holds no file
    claims: dict[str, str]  # Docker volume -> claim name
    fs_group: int | None
    probes: dict[str, ProbeSpec]
    pre_stop: Action | None
    post_start: Action | None
    grace_s: float
    user: str
    init: list[PodPlan] = field(default_factory=list)  # init containers, in order


def template_hash(deployment: dict) -> str:
    """The ReplicaSet's pod-template-hash stand-in: pods of one template share it."""
    spec = json.dumps(deployment["spec"]["template"], sort_keys=True).encode()
    return hashlib.sha256(spec).hexdigest()[:10]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) references in command, args and env values; $$ is a literal $."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def container_ports(container: dict) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in container.get("ports") or [] if p.get("name")}


def port_of(value: object, ports: dict[str, int], where: Where, path: str) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)  # type: ignore[arg-type]
    if value in ports:
        return ports[str(value)]
    raise where.error(
        path, f"port {value!r} names no port of the container (named ports: {', '.join(ports) or 'none'})"
    )


def action(spec: dict, ports: dict[str, int], where: Where, path: str) -> Action:
    kinds = [k for k in ("exec", "httpGet", "tcpSocket", "sleep") if k in spec]
    if len(kinds) != 1:
        raise where.error(path, f"needs exactly one of exec, httpGet, tcpSocket (has {kinds or 'none'})")
    kind = kinds[0]
    body = spec[kind]
    if kind == "exec":
        return Action("exec", command=[str(c) for c in body.get("command") or []])
    if kind == "sleep":
        return Action("sleep", seconds=float(body["seconds"]))
    port = port_of(body.get("port"), ports, where, f"{path}.{kind}.port")
    if kind == "tcpSocket":
        return Action("tcp", port=port)
    scheme = body.get("scheme", "HTTP")
    if scheme != "HTTP":
        raise where.error(f"{path}.httpGet.scheme", f"{scheme}: only HTTP is implemented")
    return Action(
        "http",
        port=port,
        path=body.get("path", "/"),
        scheme=scheme,
        headers={h["name"]: h["value"] for h in body.get("httpHeaders") or []},
    )


def probe(spec: dict, ports: dict[str, int], where: Where, path: str) -> ProbeSpec:
    return ProbeSpec(
        action(spec, ports, where, path),
        float(spec.get("initialDelaySeconds", 0)),
        float(spec.get("periodSeconds", 10)),
        float(spec.get("timeoutSeconds", 1)),
        int(spec.get("successThreshold", 1)),
        int(spec.get("failureThreshold", 3)),
    )


def selects(service: dict, labels: dict[str, str]) -> bool:
    selector = service.get("spec", {}).get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def service_aliases(
    objects: Objects, namespace: str, labels: dict[str, str], ports: dict[str, int]
) -> list[str]:
    """The DNS names of every Service that selects the pod: NAME, NAME.NS, NAME.NS.svc, ...cluster.local.
    A Service's name resolves to the pod's own IP, so a port must equal its targetPort."""
    names = []
    for svc in objects.of_kind("Service", namespace):
        if not selects(svc, labels):
            continue
        where = Where(objects, svc)
        kind = svc["spec"].get("type", "ClusterIP")
        if kind != "ClusterIP":
            raise where.error("spec.type", f"{kind}: only ClusterIP Services are implemented")
        for i, p in enumerate(svc["spec"].get("ports") or []):
            target = port_of(p.get("targetPort", p["port"]), ports, where, f"spec.ports[{i}].targetPort")
            if target != int(p["port"]):
                raise where.error(
                    f"spec.ports[{i}]",
                    f"port {p['port']} -> targetPort {target}: the runner's "
                    "Service names resolve to the pods' IPs, with no port mapping between",
                )
        names += dns_names(svc["metadata"]["name"], namespace)
    return names


def dns_names(name: str, namespace: str) -> list[str]:
    """A Service's names in the cluster's DNS, short to fully qualified."""
    return [name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"]


@dataclass
class PodContext:
    """Where and how one pod is made: given by the runtime, fixed per pod."""

    name: str
    ip: str
    network: str
    pod_dir: Path  # host directory of the pod's ConfigMap/Secret files and env file
    volume_prefix: str  # Docker volume of claim C: PREFIX-C
    label: str  # key=value put on every container the runner makes
    image_user: str  # the image's USER ("1000:1000", "trainapp", "" for root)
    uid: str = ""


def translate(objects: Objects, deployment: dict, ctx: PodContext) -> PodPlan:
    """The pod `ctx.name` of `deployment`: its docker arguments, files, probes and hooks."""
    where = Where(objects, deployment)
    where.refuse(unsupported(deployment, DEPLOYMENT, ""))
    namespace = namespace_of(deployment)
    template = deployment["spec"]["template"]
    labels = {str(k): str(v) for k, v in (template.get("metadata", {}).get("labels") or {}).items()}
    match = deployment["spec"].get("selector", {}).get("matchLabels") or {}
    if not match or any(labels.get(k) != v for k, v in match.items()):
        raise where.error(
            "spec.selector.matchLabels", f"{match} does not select the template's labels {labels}"
        )
    spec = template["spec"]
    sp = "spec.template.spec"
    if len(spec.get("containers") or []) != 1:
        raise where.error(
            f"{sp}.containers",
            f"{len(spec.get('containers') or [])} containers: the runner starts pods of one container",
        )
    if spec.get("restartPolicy", "Always") != "Always":
        raise where.error(f"{sp}.restartPolicy", "a Deployment's pods restart Always")
    if spec.get("dnsPolicy", "ClusterFirst") != "ClusterFirst":
        raise where.error(f"{sp}.dnsPolicy", f"{spec['dnsPolicy']}: only ClusterFirst is implemented")
    if spec.get("automountServiceAccountToken", True) is not False:
        raise where.error(
            f"{sp}.automountServiceAccountToken",
            "must be false: the runner has no API server to mint a ServiceAccount token",
        )
    c = spec["containers"][0]
    cp = f"{sp}.containers[0]"
    psc, csc = spec.get("securityContext") or {}, c.get("securityContext") or {}
    ports = container_ports(c)
    fs_group = psc.get("fsGroup")
    # --- environment: envFrom first, then env (env wins), as the kubelet does
    pod_fields = {
        "metadata.name": ctx.name,
        "metadata.namespace": namespace,
        "metadata.uid": ctx.uid or ctx.name,
        "status.podIP": ctx.ip,
        "status.podIPs": ctx.ip,
        "status.hostIP": ctx.ip,
        "spec.nodeName": NODE,
        "spec.serviceAccountName": spec.get("serviceAccountName", spec.get("serviceAccount", "default")),
    }
    env: dict[str, str] = {}
    for i, src in enumerate(c.get("envFrom") or []):
        kind, body = (
            ("ConfigMap", src["configMapRef"]) if "configMapRef" in src else ("Secret", src.get("secretRef"))
        )
        if body is None:
            raise where.error(f"{cp}.envFrom[{i}]", "needs configMapRef or secretRef")
        data = objects.data(kind, body["name"], namespace)
        if data is None:
            if body.get("optional"):
                continue
            raise where.error(
                f"{cp}.envFrom[{i}]",
                f"{kind} {body['name']} does not exist in namespace "
                f"{namespace} (create it, or mark it optional: true)",
            )
        env |= {src.get("prefix", "") + k: v.decode() for k, v in data.items()}
    for i, e in enumerate(c.get("env") or []):
        name, path = e["name"], f"{cp}.env[{i}]"
        if "valueFrom" not in e:
            env[name] = expand(str(e.get("value", "")), env)
            continue
        vf = e["valueFrom"]
        if "fieldRef" in vf:
            fp = vf["fieldRef"]["fieldPath"]
            m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", fp)
            if m:
                source = (
                    labels
                    if m.group(1) == "labels"
                    else (template.get("metadata", {}).get("annotations") or {})
                )
                env[name] = str(source.get(m.group(2), ""))
            elif fp in pod_fields:
                env[name] = pod_fields[fp]
            else:
                raise where.error(
                    f"{path}.valueFrom.fieldRef.fieldPath",
                    f"{fp} is not implemented ({', '.join(FIELD_REFS)}, metadata.labels['KEY'])",
                )
            continue
        kind, body = (
            ("Secret", vf["secretKeyRef"]) if "secretKeyRef" in vf else ("ConfigMap", vf["configMapKeyRef"])
        )
        data = objects.data(kind, body["name"], namespace)
        if data is None or body["key"] not in data:
            if body.get("optional"):
                continue
            what = f"{kind} {body['name']}" + ("" if data is None else f" has no key {body['key']!r}")
            raise where.error(
                f"{path}.valueFrom",
                f"{what}{' does not exist' if data is None else ''} in "
                f"namespace {namespace}: create it (k8s/README.md), or mark it optional",
            )
        env[name] = data[body["key"]].decode()
    for k, v in env.items():
        if "\n" in v:
            raise where.error(f"{cp}.env", f"{k}: a value with a newline cannot go into Docker's env file")
    # --- identity and privileges
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    image_uid, _, image_gid = ctx.image_user.partition(":")
    user = str(uid) if uid is not None else image_uid
    if gid is not None:
        user = f"{user or '0'}:{gid}"
    elif uid is None and image_gid:
        user = ctx.image_user
    if csc.get("runAsNonRoot", psc.get("runAsNonRoot")):
        effective = str(uid) if uid is not None else image_uid
        if not effective.isdigit():
            raise where.error(
                f"{cp}.securityContext.runAsNonRoot",
                f"the image's user {effective or 'root'!r} is "
                "not numeric: the kubelet cannot verify it is non-root; set runAsUser",
            )
        if int(effective) == 0:
            raise where.error(f"{cp}.securityContext.runAsNonRoot", "the container would run as root (uid 0)")
    if csc.get("privileged"):
        raise where.error(f"{cp}.securityContext.privileged", "privileged containers are not implemented")
    args = [
        "--hostname",
        ctx.name,
        "--label",
        ctx.label,
        "--label",
        f"dockerlet.pod={ctx.name}",
        "--network",
        ctx.network,
        "--ip",
        ctx.ip,
        "--env-file",
        str(ctx.pod_dir / "env"),
        "--restart",
        "no",
    ]
    for alias in service_aliases(objects, namespace, labels, ports):
        args += ["--network-alias", alias]
    if user:
        args += ["--user", user]
    for g in ([fs_group] if fs_group is not None else []) + list(psc.get("supplementalGroups") or []):
        args += ["--group-add", str(g)]
    if csc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    caps = csc.get("capabilities") or {}
    args += [a for cap in caps.get("drop") or [] for a in ("--cap-drop", str(cap))]
    args += [a for cap in caps.get("add") or [] for a in ("--cap-add", str(cap))]
    if csc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    elif seccomp != "RuntimeDefault":  # Docker's default profile is the runtime's default
        raise where.error(
            f"{sp}.securityContext.seccompProfile.type",
            f"{seccomp}: only RuntimeDefault and Unconfined are implemented",
        )
    # --- resources: limits as the container's limits; a CPU request weights CPU time as the kubelet's shares
    res = c.get("resources") or {}
    limits, requests = res.get("limits") or {}, res.get("requests") or {}
    if "cpu" in limits:
        args += ["--cpus", f"{cpu(limits['cpu']):g}"]
    if "memory" in limits:
        args += ["--memory", str(memory(limits["memory"]))]
    if "cpu" in requests or "cpu" in limits:
        args += ["--cpu-shares", str(max(2, int(cpu(requests.get("cpu", limits.get("cpu"))) * 1024)))]
    # --- volumes
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    files: dict[Path, tuple[bytes, int]] = {}
    dirs: list[Path] = []
    claims: dict[str, str] = {}
    mounted: set[str] = set()
    for i, m in enumerate(c.get("volumeMounts") or []):
        path = f"{cp}.volumeMounts[{i}]"
        vol = volumes.get(m["name"])
        if vol is None:
            raise where.error(
                f"{path}.name", f"{m['name']!r} is no volume of the pod ({', '.join(volumes) or 'none'})"
            )
        target, sub, ro = m["mountPath"], m.get("subPath", ""), bool(m.get("readOnly"))
        if "emptyDir" in vol:
            if sub or m["name"] in mounted:
                raise where.error(path, "an emptyDir is a tmpfs here: mounted once, without subPath")
            opts = [f"type=tmpfs,destination={target}", "tmpfs-mode=1777"]
            if (vol["emptyDir"] or {}).get("sizeLimit"):
                opts.append(f"tmpfs-size={memory(vol['emptyDir']['sizeLimit'])}")
            args += ["--mount", ",".join(opts)]
        elif "configMap" in vol or "secret" in vol:
            kind = "ConfigMap" if "configMap" in vol else "Secret"
            body = vol["configMap"] if kind == "ConfigMap" else vol["secret"]
            name = body.get("name") if kind == "ConfigMap" else body.get("secretName")
            data = objects.data(kind, name, namespace)
            if data is None and not body.get("optional"):
                raise where.error(
                    f"{sp}.volumes[{list(volumes).index(m['name'])}]",
                    f"{kind} {name} does not exist in namespace {namespace}",
                )
            data = data or {}
            mode = int(body.get("defaultMode", 0o644))
            items = body.get("items") or [{"key": k, "path": k} for k in sorted(data)]
            vdir = ctx.pod_dir / "volumes" / m["name"]
            for it in items:
                if it["key"] not in data:
                    if body.get("optional"):
                        continue
                    raise where.error(f"{sp}.volumes", f"{kind} {name} has no key {it['key']!r}")
                files[vdir / it["path"]] = (data[it["key"]], int(it.get("mode", mode)))
            source = vdir / sub if sub else vdir
            args += ["--mount", f"type=bind,source={source},destination={target},readonly"]
            if not sub:
                dirs.append(vdir)
        elif "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            if objects.get("PersistentVolumeClaim", claim, namespace) is None:
                raise where.error(
                    f"{sp}.volumes", f"PersistentVolumeClaim {claim} does not exist in {namespace}"
                )
            if sub:
                raise where.error(f"{path}.subPath", "subPath of a claim is not implemented")
            volume = f"{ctx.volume_prefix}-{claim}"
            claims[volume] = claim
            ro = ro or bool(vol["persistentVolumeClaim"].get("readOnly"))
            args += [
                "--mount",
                f"type=volume,source={volume},destination={target}" + (",readonly" if ro else ""),
            ]
        else:
            raise where.error(f"{sp}.volumes", f"volume {m['name']!r} has no type the runner implements")
        mounted.add(m["name"])
    if c.get("workingDir"):
        args += ["--workdir", str(c["workingDir"])]
    # --- command: `command` replaces the image's ENTRYPOINT (and its CMD), `args` its CMD
    command = [expand(str(x), env) for x in c.get("command") or []]
    cargs = [expand(str(x), env) for x in c.get("args") or []]
    if command:
        args += ["--entrypoint", command[0], c["image"], *command[1:], *cargs]
    else:
        args += [c["image"], *cargs]
    init = []
    for i, ic in enumerate(spec.get("initContainers") or []):
        # An init container as a pod of its own container, same name, IP and volumes, run before the main one.
        alone = copy.deepcopy(deployment)
        alone["spec"]["template"]["spec"]["containers"] = [ic]
        alone["spec"]["template"]["spec"].pop("initContainers")
        sub = dataclasses.replace(ctx, pod_dir=ctx.pod_dir / f"init-{i}")
        try:
            init.append(translate(objects, alone, sub))
        except ManifestError as e:
            raise ManifestError(
                str(e).replace("spec.template.spec.containers[0]", f"spec.template.spec.initContainers[{i}]")
            ) from None
    probes = {
        kind: probe(c[f"{kind}Probe"], ports, where, f"{cp}.{kind}Probe")
        for kind in ("startup", "liveness", "readiness")
        if c.get(f"{kind}Probe")
    }
    lifecycle = c.get("lifecycle") or {}
    pre_stop = (
        action(lifecycle["preStop"], ports, where, f"{cp}.lifecycle.preStop")
        if "preStop" in lifecycle
        else None
    )
    post_start = (
        action(lifecycle["postStart"], ports, where, f"{cp}.lifecycle.postStart")
        if "postStart" in lifecycle
        else None
    )
    return PodPlan(
        name=ctx.name,
        namespace=namespace,
        owner=ref(deployment),
        source=objects.source(deployment),
        ip=ctx.ip,
        labels=labels,
        container=c["name"],
        image=c["image"],
        create_args=args,
        env=env,
        env_file=ctx.pod_dir / "env",
        files=files,
        dirs=dirs,
        claims=claims,
        fs_group=fs_group,
        probes=probes,
        pre_stop=pre_stop,
        post_start=post_start,
        grace_s=float(spec.get("terminationGracePeriodSeconds", 30)),
        user=user,
        init=init,
    )
