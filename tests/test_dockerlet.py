"""The container smoke's pod runner (scripts/dockerlet) without Docker: the kind overlay's pod templates
translated to `docker create` arguments, every field it does not implement refused in one line, the
probe rules, and the preflight that catches a changed manifest (a ConfigMap mounted elsewhere, a module
renamed, a Service name misspelt) in one line naming what broke. The pods themselves start in
`make container-smoke` (.ci/run), which also runs one such change for real."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO, render_overlay

sys.path.insert(0, str(REPO / "scripts"))
from dockerlet import kuberay, preflight  # noqa: E402
from dockerlet.manifests import ManifestError, Objects  # noqa: E402
from dockerlet.podspec import PodContext, check_fields, cpu, expand, memory, translate  # noqa: E402
from dockerlet.probes import ContainerProbes  # noqa: E402
from dockerlet.runtime import free_subnet, write_files  # noqa: E402

RAYJOB = yaml.safe_load((REPO / "k8s/kuberay/rayjob.train.yaml").read_text())
JOB = preflight.Job(
    " ".join(RAYJOB["spec"]["entrypoint"].split()), "k8s/kuberay/rayjob.train.yaml spec.entrypoint"
)


@pytest.fixture(scope="module")
def rendered() -> str:
    return render_overlay("kind-cpu")


def objects_of(text: str) -> Objects:
    objects = Objects.load(text, REPO / "k8s")
    objects.add(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "ray-auth-token", "namespace": "trainapp"},
            "stringData": {"token": "t0ken"},
        }
    )
    return objects


@pytest.fixture
def objects(rendered) -> Objects:
    return objects_of(rendered)


def deployment(objects: Objects, name: str) -> dict:
    dep = objects.get("Deployment", name, "trainapp")
    assert dep is not None, [o["metadata"]["name"] for o in objects.of_kind("Deployment")]
    return dep


def ctx(tmp_path: Path, name: str = "pod-a", image_user: str = "1000:1000") -> PodContext:
    return PodContext(
        name=name,
        ip="10.244.100.10",
        network="net",
        pod_dir=tmp_path / name,
        volume_prefix="pfx",
        label="smoke=1",
        image_user=image_user,
    )


def check(objects: Objects) -> None:
    preflight.check(
        objects,
        module_exists=lambda m: importlib.util.find_spec(m) is not None,
        file_in_image=lambda p: False,
        jobs=[JOB],
    )


def pairs(args: list[str]) -> list[tuple[str, str]]:
    return list(zip(args, args[1:]))


# ------------------------------------------------------------------------------------ translation


def test_the_head_pod_runs_as_its_template_says(objects, tmp_path):
    plan = translate(objects, deployment(objects, "ray-head"), ctx(tmp_path))
    a = plan.create_args
    assert plan.owner == "Deployment/ray-head" and plan.source == "k8s/deployment.ray-head.yaml"
    # securityContext: the pod's user and group, fsGroup as a supplementary group, the container's lockdown
    for pair in [
        ("--user", "1000:1000"),
        ("--group-add", "1000"),
        ("--cap-drop", "ALL"),
        ("--security-opt", "no-new-privileges"),
        ("--cpus", "2"),
        ("--memory", str(3 * 2**30)),
        ("--cpu-shares", "256"),
        ("--ip", "10.244.100.10"),
        ("--hostname", "pod-a"),
    ]:
        assert pair in pairs(a), pair
    assert "--read-only" in a
    # the Service selects the head: its names resolve to the pod
    aliases = [v for k, v in pairs(a) if k == "--network-alias"]
    assert aliases == [
        "ray-head",
        "ray-head.trainapp",
        "ray-head.trainapp.svc",
        "ray-head.trainapp.svc.cluster.local",
    ]
    mounts = [v for k, v in pairs(a) if k == "--mount"]
    assert f"type=tmpfs,destination=/dev/shm,tmpfs-mode=1777,tmpfs-size={512 * 2**20}" in mounts
    assert "type=volume,source=pfx-trainapp-runs,destination=/mnt/runs" in mounts
    assert f"type=bind,source={tmp_path}/pod-a/volumes/config,destination=/etc/trainapp,readonly" in mounts
    config = yaml.safe_load(plan.files[tmp_path / "pod-a/volumes/config/config.yaml"][0])
    assert config["ray"]["storage_path"] == "/mnt/runs"
    # command replaces the entrypoint, args follow the image
    i = a.index("--entrypoint")
    assert a[i + 1 : i + 5] == ["ray", "trainapp:0.1.0-cpu", "start", "--head"]
    # env: the Secret's token and envFrom's ConfigMap, in the env file, not on the command line
    assert plan.env["RAY_AUTH_TOKEN"] == "t0ken" and plan.env["NCCL_DEBUG"] == "WARN"
    assert "t0ken" not in " ".join(a)
    write_files(plan)
    assert (tmp_path / "pod-a/env").stat().st_mode & 0o777 == 0o600
    assert "RAY_AUTH_TOKEN=t0ken\n" in (tmp_path / "pod-a/env").read_text()
    assert (plan.probes["readiness"].action.kind, plan.probes["readiness"].action.port) == ("tcp", 8265)
    assert plan.probes["liveness"].initial_delay == 30 and plan.grace_s == 30


def test_the_worker_pods_come_from_the_gpu_manifest_as_the_overlay_renames_it(objects, tmp_path):
    plan = translate(objects, deployment(objects, "ray-cpu-workers"), ctx(tmp_path))
    renamed = "renamed ray-cpu-workers by k8s/overlays/kind-cpu"
    assert plan.source == f"k8s/deployment.ray-gpu-workers.yaml, {renamed}"
    assert "--network-alias" not in plan.create_args  # no Service selects the workers
    assert plan.pre_stop is not None and plan.pre_stop.command[:4] == ["python", "-m", "trainapp", "drain"]
    assert plan.grace_s == 45 and plan.probes["readiness"].action.port == 6380  # the named port raylet


def test_env_value_from_fields_config_maps_and_expansion(objects, tmp_path):
    dep = copy.deepcopy(deployment(objects, "ray-head"))
    c = dep["spec"]["template"]["spec"]["containers"][0]
    c["env"] += [
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {
            "name": "PART",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app.kubernetes.io/component']"}},
        },
        {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "trainapp-nccl", "key": "NCCL_DEBUG"}}},
        {"name": "GONE", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}},
        {"name": "ADDR", "value": "$(IP):6379 $$(IP)"},
    ]
    c["workingDir"] = "/tmp"
    c["args"] = ["start", "--node-ip-address=$(IP)"]
    plan = translate(objects, dep, ctx(tmp_path, "head-x"))
    assert {k: plan.env[k] for k in ("POD", "IP", "NS", "PART", "LEVEL", "ADDR")} == {
        "POD": "head-x",
        "IP": "10.244.100.10",
        "NS": "trainapp",
        "PART": "ray-head",
        "LEVEL": "WARN",
        "ADDR": "10.244.100.10:6379 $(IP)",
    }
    assert "GONE" not in plan.env
    assert plan.create_args[-1] == "--node-ip-address=10.244.100.10" and ("--workdir", "/tmp") in pairs(
        plan.create_args
    )
    assert expand("$(NOPE) $$", {}) == "$(NOPE) $"


def test_config_map_items_and_sub_path_mount_one_file(objects, tmp_path):
    dep = copy.deepcopy(deployment(objects, "ray-head"))
    spec = dep["spec"]["template"]["spec"]
    spec["volumes"].append(
        {
            "name": "one",
            "configMap": {
                "name": "trainapp-config",
                "defaultMode": 0o440,
                "items": [{"key": "config.yaml", "path": "conf/train.yaml"}],
            },
        }
    )
    spec["containers"][0]["volumeMounts"].append(
        {"name": "one", "mountPath": "/opt/train.yaml", "subPath": "conf/train.yaml"}
    )
    plan = translate(objects, dep, ctx(tmp_path))
    assert plan.files[tmp_path / "pod-a/volumes/one/conf/train.yaml"][1] == 0o440
    assert (
        f"type=bind,source={tmp_path}/pod-a/volumes/one/conf/train.yaml,destination=/opt/train.yaml,readonly"
        in plan.create_args
    )


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda s: s["containers"][0].update(startupProbe={"grpc": {"port": 1}}),
            "spec.template.spec.containers[0].startupProbe.grpc is not implemented by the container smoke's "
            "pod runner",
        ),
        (
            lambda s: s.update(nodeSelector={"gpu": "yes"}),
            "spec.template.spec.nodeSelector is not implemented",
        ),
        (
            lambda s: s["containers"][0]["resources"]["limits"].update({"nvidia.com/gpu": 1}),
            "spec.template.spec.containers[0].resources.limits.nvidia.com/gpu is not implemented",
        ),
        (
            lambda s: s.update(automountServiceAccountToken=True),
            "spec.template.spec.automountServiceAccountToken: must be false",
        ),
        (lambda s: s["securityContext"].update(runAsUser=0), "runAsNonRoot: the container would run as root"),
        (
            lambda s: s["containers"][0]["env"].append(
                {"name": "X", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}
            ),
            "env[2].valueFrom: Secret absent does not exist in namespace trainapp",
        ),
        (
            lambda s: s["containers"][0]["readinessProbe"]["tcpSocket"].update(port="nope"),
            "readinessProbe.tcpSocket.port: port 'nope' names no port of the container",
        ),
    ],
)
def test_a_field_the_runner_does_not_implement_is_one_line_naming_file_object_and_field(
    objects, tmp_path, change, expected
):
    dep = deployment(objects, "ray-head")
    change(dep["spec"]["template"]["spec"])
    with pytest.raises(ManifestError) as e:
        check_fields(objects)
        translate(objects, dep, ctx(tmp_path))
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("k8s/deployment.ray-head.yaml Deployment/ray-head: "), line
    assert expected in line, line


def test_an_image_user_by_name_cannot_be_checked_non_root(objects, tmp_path):
    dep = deployment(objects, "ray-head")
    for sc in (dep["spec"]["template"]["spec"]["securityContext"],):
        sc.pop("runAsUser"), sc.pop("runAsGroup")
    with pytest.raises(ManifestError, match="the image's user 'trainapp' is not numeric"):
        translate(objects, dep, ctx(tmp_path, image_user="trainapp"))


def test_an_unknown_kind_in_the_rendered_set_is_refused(rendered):
    with pytest.raises(ManifestError, match="kind 'CronJob' is not one the runner starts"):
        Objects.load(rendered + "\n---\napiVersion: batch/v1\nkind: CronJob\nmetadata: {name: x}\n")


def test_quantities():
    assert (cpu("500m"), cpu("2"), cpu(0.25)) == (0.5, 2.0, 0.25)
    assert (memory("3Gi"), memory("512Mi"), memory("1G"), memory(1000), memory("1e3")) == (
        3 * 2**30,
        512 * 2**20,
        10**9,
        1000,
        1000,
    )


# ------------------------------------------------------------------------------------------ probes


def test_probes_wait_their_delay_need_their_thresholds_and_startup_holds_the_others_back(objects, tmp_path):
    plan = translate(objects, deployment(objects, "ray-cpu-workers"), ctx(tmp_path))
    p = ContainerProbes(plan.probes, started_at=100.0)
    assert not p.ready and p.due(104.9) == [] and p.due(105) == ["readiness"]
    assert p.record("readiness", True, 105) is None and p.ready
    assert p.due(109) == [] and p.due(130) == ["liveness", "readiness"]
    for t in (130, 140):
        assert p.record("liveness", False, t) is None
    assert p.record("liveness", True, 150) is None  # a pass resets the count
    assert [p.record("liveness", False, t) for t in (160, 170, 180)] == [None, None, "restart"]
    for t in (130, 135):
        p.record("readiness", False, t)
    assert p.ready
    p.record("readiness", False, 140)
    assert not p.ready  # failureThreshold 3 (the default)

    startup = copy.deepcopy(plan.probes)
    startup["startup"] = copy.deepcopy(startup["readiness"])
    startup["startup"].failure_threshold = 2
    q = ContainerProbes(startup, started_at=0.0)
    assert q.due(50) == ["startup"] and not q.ready
    assert q.record("startup", False, 50) is None and q.record("startup", False, 55) == "restart"
    q.record("startup", True, 60)
    assert q.due(60) == ["liveness", "readiness"] and not q.ready


# ---------------------------------------------------------------------------------------- preflight


def test_the_rendered_overlay_and_the_rayjob_entrypoint_pass_the_preflight(objects):
    check_fields(objects)
    check(objects)


def mutate(rendered: str, old: str, new: str) -> Objects:
    assert old in rendered, old
    return objects_of(rendered.replace(old, new))


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        # the ConfigMap mounted somewhere else than the entrypoint's --config
        (
            "- mountPath: /etc/trainapp\n",
            "- mountPath: /etc/trainapp-config\n",
            "k8s/kuberay/rayjob.train.yaml spec.entrypoint (run on the head, k8s/deployment.ray-head.yaml "
            "Deployment/ray-head): --config /etc/trainapp/config.yaml is in no volume of the pod",
        ),
        # the worker command's module renamed
        (
            "        - -m\n        - trainapp\n        - node\n",
            "        - -m\n        - trainapp_node\n        - node\n",
            "Deployment/ray-cpu-workers: spec.template.spec.containers[0].command: "
            "`python -m trainapp_node`: the image has no module 'trainapp_node'",
        ),
        # the Service name the workers join
        (
            "--address=ray-head:6379",
            "--address=ray-hed:6379",
            "Deployment/ray-cpu-workers: spec.template.spec.containers[0]: '--address=ray-hed:6379' names no "
            "Service of namespace trainapp (Services: ray-head)",
        ),
        # the Service's port
        ("--address=ray-head:6379", "--address=ray-head:6380", "Service ray-head has no port 6380"),
    ],
)
def test_a_changed_manifest_fails_the_preflight_in_one_line_naming_what_broke(rendered, old, new, expected):
    objects = mutate(rendered, old, new)
    with pytest.raises(ManifestError) as e:
        check_fields(objects)
        check(objects)
    assert "\n" not in str(e.value) and expected in str(e.value), str(e.value)


def test_the_run_claim_missing_from_the_worker_pods_fails_naming_their_manifest(objects):
    workers = deployment(objects, "ray-cpu-workers")["spec"]["template"]["spec"]
    mounts = workers["containers"][0]["volumeMounts"]
    mounts[:] = [m for m in mounts if m["mountPath"] != "/mnt/runs"]
    with pytest.raises(
        ManifestError,
        match="storage /mnt/runs is not on a claim mounted by "
        r"k8s/deployment.ray-gpu-workers.yaml, renamed ray-cpu-workers",
    ):
        check(objects)


def test_the_config_key_renamed_in_the_config_map_fails_naming_the_volume(rendered):
    objects = mutate(rendered, "  config.yaml: |", "  train.yaml: |")
    with pytest.raises(
        ManifestError,
        match=r"--config /etc/trainapp/config.yaml: the volume 'config' mounted at "
        r"/etc/trainapp has no such file",
    ):
        check(objects)


def test_a_free_subnet_avoids_the_hosts_routes():
    routes = "default via 10.0.0.1 dev eth0\n10.244.100.0/22 dev br0\n10.0.0.0/24 dev eth0\n"
    assert free_subnet(routes) == "10.244.104.0/24"


# ------------------------------------------------------------------------------------------- KubeRay


@pytest.fixture(scope="module")
def rendered_kuberay() -> str:
    return render_overlay("kind-cpu-kuberay")


def test_the_rayclusters_pods_are_built_as_the_kuberay_operator_builds_them(rendered_kuberay, tmp_path):
    objects = objects_of(rendered_kuberay)
    kuberay.expand(objects)
    check_fields(objects)
    check(objects)  # modules, the head Service's name in the workers' address, the job's config and storage
    head = deployment(objects, "trainapp-cpu-head")
    workers = deployment(objects, "trainapp-cpu-cpu-worker")
    assert workers["spec"]["replicas"] == 2
    assert objects.source(workers) == ("k8s/kuberay/raycluster.gpu.yaml, renamed trainapp-cpu by "
                                       "k8s/overlays/kind-cpu-kuberay RayCluster/trainapp-cpu "
                                       "spec.workerGroupSpecs[cpu] (as KubeRay v1.7.0 builds it)")
    hc = head["spec"]["template"]["spec"]["containers"][0]
    assert hc["command"] == ["/bin/bash", "-c", "--"]
    assert hc["args"][0].startswith(
        "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start --head --block "
        "--dashboard-agent-listen-port=52365 --dashboard-host=0.0.0.0 ")
    assert "--num-cpus=0" in hc["args"][0] and f"--memory={3 * 2**30}" in hc["args"][0]
    wc = workers["spec"]["template"]["spec"]["containers"][0]
    address = "trainapp-cpu-head-svc.trainapp.svc.cluster.local:6379"
    assert f"ray start --address={address} --block" in wc["args"][0] and "--num-cpus=1" in wc["args"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in wc["env"]}
    assert env["FQ_RAY_IP"] == address.split(":")[0] and env["RAY_IP"] == "trainapp-cpu-head-svc"
    assert env["KUBERAY_GEN_RAY_START_CMD"] == wc["args"][0].split("; ", 1)[1]
    assert env["RAY_CLUSTER_NAME"] == {"fieldRef": {"fieldPath": "metadata.labels['ray.io/cluster']"}}
    labels = workers["spec"]["template"]["metadata"]["labels"]
    assert (labels["ray.io/node-type"], labels["ray.io/group"], labels["app.kubernetes.io/created-by"]) == (
        "worker", "cpu", "kuberay-operator")
    # The worker pod: its init container waits for the GCS through the head Service, then the container.
    plan = translate(objects, workers, ctx(tmp_path, "w-0"))
    assert [p.container for p in plan.init] == ["wait-gcs-ready"]
    init = plan.init[0]
    assert ("--ip", "10.244.100.10") in pairs(init.create_args)
    assert f"ray health-check --address {address}" in init.create_args[-1]
    assert init.env["RAY_AUTH_TOKEN"] == "t0ken" and ("--cpus", "0.2") in pairs(init.create_args)
    assert plan.env["RAY_CLUSTER_NAME"] == "trainapp-cpu" and plan.env["RAY_CLOUD_INSTANCE_ID"] == "w-0"
    # The head Service KubeRay makes selects the head pod: its names resolve there.
    head_plan = translate(objects, head, ctx(tmp_path, "h-0"))
    assert "trainapp-cpu-head-svc.trainapp.svc.cluster.local" in head_plan.create_args


def test_the_gpu_raycluster_as_written_is_refused_by_the_cpu_runner_in_one_line(tmp_path):
    objects = Objects([yaml.safe_load((REPO / "k8s/kuberay/raycluster.gpu.yaml").read_text())],
                      sources={("RayCluster", "trainapp-gpu"): "k8s/kuberay/raycluster.gpu.yaml"})
    kuberay.expand(objects)
    with pytest.raises(ManifestError) as e:
        check_fields(objects)
    assert str(e.value).startswith(
        "k8s/kuberay/raycluster.gpu.yaml RayCluster/trainapp-gpu spec.workerGroupSpecs[gpu]")
    assert "spec.template.spec.tolerations is not implemented" in str(e.value)


def test_a_head_template_that_names_itself_leaves_kuberays_head_service_without_a_pod(rendered_kuberay,
                                                                                      tmp_path):
    # KubeRay's head Service selects app.kubernetes.io/name=kuberay: the raycluster's header says to leave it.
    old = "app.kubernetes.io/component: ray-head\n"
    rendered = rendered_kuberay.replace(old, old + "          app.kubernetes.io/name: mine\n")
    assert rendered != rendered_kuberay
    objects = objects_of(rendered)
    kuberay.expand(objects)
    plan = translate(objects, deployment(objects, "trainapp-cpu-head"), ctx(tmp_path, "h-0"))
    assert "trainapp-cpu-head-svc" not in plan.create_args
    with pytest.raises(ManifestError, match=r"Service/trainapp-cpu-head-svc: spec.selector .* selects no"):
        check(objects)
