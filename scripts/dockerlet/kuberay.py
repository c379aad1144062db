"""A RayCluster's pods as the KubeRay operator would build them (v1.7.0, ray-operator/controllers/ray/
common/pod.go: DefaultHeadPodTemplate, DefaultWorkerPodTemplate, BuildPod), as Deployment-shaped objects
the runner starts like any other: one for the head group, one per worker group.

What the operator adds to each template, and so does this:
- labels ray.io/cluster, ray.io/node-type, ray.io/group, ray.io/is-ray-node, ray.io/identifier,
  app.kubernetes.io/name=kuberay, app.kubernetes.io/created-by=kuberay-operator (the template's own labels
  kept, but the three ray.io keys it may not override);
- the Ray container's command: `/bin/bash -c -- "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start
  ..."` built from rayStartParams (sorted; `true` flags bare, `false` ones dropped) completed with --block,
  --metrics-export-port=8080, --dashboard-agent-listen-port=52365, the head's --dashboard-host=0.0.0.0, a
  worker's --address=HEADSVC.NS.svc.cluster.local:PORT, --num-cpus and --memory from the limits, --num-gpus
  from nvidia.com/gpu; a container command of the user's that has no `ray start` runs first (`CMD && ...`);
- its environment: RAY_CLUSTER_NAME, RAY_CLUSTER_NAMESPACE, RAY_CLOUD_INSTANCE_ID, RAY_NODE_TYPE_NAME,
  KUBERAY_GEN_RAY_START_CMD, RAY_PORT, RAY_ADDRESS, RAY_USAGE_STATS_KUBERAY_IN_USE,
  RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE (the head also RAY_USAGE_STATS_EXTRA_TAGS; workers FQ_RAY_IP, RAY_IP);
- a `metrics` port 8080 when the container has none; a /dev/shm emptyDir (medium Memory) when none is
  mounted; liveness and readiness probes (HTTP /api/healthz on 52365, Ray >= 2.53) when the template has
  none;
- the worker's init container `wait-gcs-ready` (a `ray health-check` loop against the head Service);
- the head Service HEAD-svc: the head container's ports, selecting the head pod.

Not done here: the autoscaler sidecar (enableInTreeAutoscaling), GCS fault tolerance, TLS, RayJob's
submitter pod; the runner refuses what they would need.
"""

from __future__ import annotations

import copy
import math

from .manifests import Objects, namespace_of
from .podspec import cpu, memory

KUBERAY_VERSION = "v1.7.0"
AGENT_PORT, METRICS_PORT = 52365, 8080
PROTECTED = ("ray.io/node-type", "ray.io/group", "ray.io/cluster")


def head_service_name(cluster: dict) -> str:
    svc = (cluster["spec"]["headGroupSpec"].get("headService") or {}).get("metadata", {}).get("name")
    return svc or f"{cluster['metadata']['name']}-head-svc"


def params_flags(params: dict[str, str]) -> str:
    out = []
    for key in sorted(params):
        value = str(params[key])
        if value.lower() in ("true", "false") and key not in (
            "log-color",
            "include-dashboard",
            "include-log-monitor",
        ):
            if value.lower() == "true":
                out.append(f"--{key}")
        else:
            out.append(f"--{key}={value}")
    return " ".join(out)


def ray_start(kind: str, params: dict[str, str], resources: dict) -> str:
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    cores = limits.get("cpu", requests.get("cpu"))
    if "num-cpus" not in params and cores is not None:
        params["num-cpus"] = str(math.ceil(cpu(cores)))  # Quantity.Value() rounds up
    if "memory" not in params and "memory" in limits:
        params["memory"] = str(memory(limits["memory"]))
    if "num-gpus" not in params and "nvidia.com/gpu" in limits:
        params["num-gpus"] = str(limits["nvidia.com/gpu"])
    return f"ray start {'--head ' if kind == 'head' else ''}{params_flags(params)}"


def pod_template(cluster: dict, group: dict, kind: str) -> dict:
    name, ns = cluster["metadata"]["name"], namespace_of(cluster)
    group_name = "headgroup" if kind == "head" else group["groupName"]
    head_params = {
        k: str(v) for k, v in (cluster["spec"]["headGroupSpec"].get("rayStartParams") or {}).items()
    }
    head_port = head_params.get("port", "6379")
    fqdn = f"{head_service_name(cluster)}.{ns}.svc.cluster.local"
    template = copy.deepcopy(group["template"])
    meta = template.setdefault("metadata", {})
    labels = {
        "ray.io/is-ray-node": "yes",
        "ray.io/cluster": name,
        "ray.io/node-type": kind,
        "ray.io/group": group_name,
        "ray.io/identifier": f"{name}-{kind}",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    labels |= {k: v for k, v in (meta.get("labels") or {}).items() if k not in PROTECTED}
    meta["labels"] = labels
    spec = template["spec"]
    c = spec["containers"][0]
    params = {k: str(v) for k, v in (group.get("rayStartParams") or {}).items()}
    if kind == "worker":
        params.setdefault("address", f"{fqdn}:{head_port}")
    else:
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", str(METRICS_PORT))
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", str(AGENT_PORT))
    # /dev/shm for the object store, unless mounted or a plasma directory is set
    if "plasma-directory" not in params and not any(
        m["mountPath"] == "/dev/shm" for m in c.get("volumeMounts") or []
    ):
        spec.setdefault("volumes", []).append({"name": "shared-mem", "emptyDir": {"medium": "Memory"}})
        c.setdefault("volumeMounts", []).append({"name": "shared-mem", "mountPath": "/dev/shm"})
    user_cmd = " ".join(str(x) for x in (c.get("command") or []) + (c.get("args") or []))
    start = ray_start(kind, params, c.get("resources") or {})
    if "ray start" not in user_cmd:
        generated = f"ulimit -n ${{RAY_START_ULIMIT_OPEN_FILES:-65536}}; {start}"
        c["command"] = ["/bin/bash", "-c", "--"]
        c["args"] = [f"{user_cmd} && {generated}" if user_cmd else generated]
    user_env = copy.deepcopy(c.get("env") or [])  # what the init container copies
    env = c.setdefault("env", [])
    names = {e["name"] for e in env}

    def add(name: str, value: str | None = None, field: str | None = None, always: bool = True) -> None:
        if always or name not in names:
            env.append(
                {"name": name, "value": value}
                if field is None
                else {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}}
            )
            names.add(name)

    if kind == "worker":
        add("FQ_RAY_IP", fqdn)
        add("RAY_IP", fqdn.split(".")[0])
    add("RAY_CLUSTER_NAME", field="metadata.labels['ray.io/cluster']")
    add("RAY_CLUSTER_NAMESPACE", field="metadata.namespace")
    add("RAY_CLOUD_INSTANCE_ID", field="metadata.name")
    add("RAY_NODE_TYPE_NAME", field="metadata.labels['ray.io/group']")
    add("KUBERAY_GEN_RAY_START_CMD", start)
    add("RAY_PORT", head_port, always=False)
    add("RAY_ADDRESS", f"{'127.0.0.1' if kind == 'head' else fqdn}:{head_port}", always=False)
    add("RAY_USAGE_STATS_KUBERAY_IN_USE", "1", always=False)
    if kind == "head":
        add("RAY_USAGE_STATS_EXTRA_TAGS", f"kuberay_version={KUBERAY_VERSION};kuberay_crd=RayCluster")
    add("RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE", "1", always=False)
    ports = c.setdefault("ports", [])
    if not any(p.get("name") == "metrics" for p in ports):
        ports.append({"name": "metrics", "containerPort": METRICS_PORT})
    for probe in ("livenessProbe", "readinessProbe"):
        if probe not in c:  # Ray >= 2.53: one HTTP health endpoint on the dashboard agent
            c[probe] = {
                "httpGet": {"path": "/api/healthz", "port": int(params["dashboard-agent-listen-port"])},
                "initialDelaySeconds": 10,
                "periodSeconds": 5,
                "failureThreshold": 120 if probe == "livenessProbe" else 10,
                "timeoutSeconds": 5 if kind == "head" else 1,
            }
    if kind == "worker":
        wait = (
            f"SECONDS=0; while true; do if ray health-check --address {fqdn}:{head_port} > /dev/null 2>&1; "
            f"then echo 'GCS is ready.'; break; fi; echo \"$SECONDS seconds elapsed: Waiting for GCS to be "
            'ready."; sleep 5; done'
        )
        spec.setdefault("initContainers", []).insert(
            0,
            {
                "name": "wait-gcs-ready",
                "image": c["image"],
                "imagePullPolicy": c.get("imagePullPolicy", "IfNotPresent"),
                "command": ["/bin/bash", "-c", "--"],
                "args": [wait],
                "securityContext": copy.deepcopy(c.get("securityContext") or {}),
                "env": user_env
                + [{"name": "FQ_RAY_IP", "value": fqdn}, {"name": "RAY_IP", "value": fqdn.split(".")[0]}],
                "volumeMounts": copy.deepcopy(c.get("volumeMounts") or []),
                "resources": {
                    "limits": {"cpu": "200m", "memory": "256Mi"},
                    "requests": {"cpu": "200m", "memory": "256Mi"},
                },
            },
        )
    return template


def objects_of(cluster: dict, source: str) -> tuple[list[dict], dict, dict[tuple[str, str], str]]:
    """(Deployments, the head Service, their sources) for one RayCluster."""
    name, ns = cluster["metadata"]["name"], namespace_of(cluster)
    groups = [("head", cluster["spec"]["headGroupSpec"], f"{name}-head", 1)]
    groups += [
        ("worker", g, f"{name}-{g['groupName']}-worker", int(g.get("replicas", g.get("minReplicas", 0))))
        for g in cluster["spec"].get("workerGroupSpecs") or []
    ]
    deployments, sources = [], {}
    for kind, group, dep_name, replicas in groups:
        template = pod_template(cluster, group, kind)
        match = {"ray.io/cluster": name, "ray.io/group": template["metadata"]["labels"]["ray.io/group"]}
        deployments.append(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": dep_name, "namespace": ns},
                "spec": {"replicas": replicas, "selector": {"matchLabels": match}, "template": template},
            }
        )
        where = "spec.headGroupSpec" if kind == "head" else f"spec.workerGroupSpecs[{group['groupName']}]"
        sources[("Deployment", dep_name)] = (
            f"{source} RayCluster/{name} {where} (as KubeRay {KUBERAY_VERSION} builds it)"
        )
    head = deployments[0]["spec"]["template"]["spec"]["containers"][0]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": head_service_name(cluster), "namespace": ns},
        "spec": {
            # HeadServiceLabels (service.go): a template label app.kubernetes.io/name would leave it no pod.
            "selector": {
                "ray.io/cluster": name,
                "ray.io/node-type": "head",
                "ray.io/identifier": f"{name}-head",
                "app.kubernetes.io/name": "kuberay",
                "app.kubernetes.io/created-by": "kuberay-operator",
            },
            "ports": [
                {"name": p["name"], "port": p["containerPort"], "targetPort": p["containerPort"]}
                for p in head.get("ports") or []
                if p.get("name")
            ],
        },
    }
    sources[("Service", service["metadata"]["name"])] = (
        f"{source} RayCluster/{name} (the head Service KubeRay makes)"
    )
    return deployments, service, sources


def expand(objects: Objects) -> None:
    """Add every RayCluster's Deployments and head Service to the rendered set, with their sources."""
    for cluster in objects.of_kind("RayCluster"):
        deployments, service, sources = objects_of(cluster, objects.source(cluster))
        for obj in [*deployments, service]:
            objects.add(obj)
        objects.sources |= sources
