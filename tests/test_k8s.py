"""Static checks of the Kubernetes and KubeRay manifests in k8s/ (no cluster needed): every file parses
and has its Apply/Check/Logs/Clean header; the kind overlay renders (kubectl kustomize); the core
objects validate against Kubernetes 1.32's schemas (kubernetes-validate --strict); the RayCluster and
RayJob agree with each other and with the training run; every pod template is locked down and gets
Ray's token from the Secret; every Ray worker pod drains on deletion (preStop `trainapp drain`) with
numbers that fit its grace period and the config's `preempt.grace_s`; no file in k8s/ or ray_cluster/
pins NCCL's or Gloo's interface (that would win over `network.interface=auto`); yamllint and checkov
report nothing, and checkov skips are reviewed.

checkov runs once per target (module-scoped fixtures): the plain manifests (`-d k8s`), the rendered
overlay, and the KubeRay pod templates wrapped as the Pods and Job KubeRay makes of them, because
checkov reads no custom resources (a RayCluster or RayJob counts as 0 resources, with 0 checks).
The last tests break copies on purpose and check that the checks above notice. The checkers themselves,
and the paths and names they check against, are in tests/k8s_checks.py."""

from __future__ import annotations

import copy
import re
import secrets
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pytest
import yaml
from helpers import REPO, render_overlay, tool
from k8s_checks import (ALL_YAML, ALLOWED_CHECKOV_SKIPS, CPU_IMAGE, IFNAME_VARS, K8S, KIND_CLUSTER, OVERLAY,
                        PIN_SCANNED, PLAIN, RAYCLUSTER, RAYJOB, RUNS_CLAIM, RUNS_MOUNT, STATIC_PODS, VERSION,
                        WORKER_PODS, Pod, by_kind, checkov_problems, config_grace_s, docs, elastic_range,
                        header_problems, interface_pins, is_core, kuberay_as_core_objects,
                        kubernetes_validate_problems, load, pod_problems, pods_of, preemption_problems,
                        ray_pin, rayjob_overrides, rel, resolved_config, run_checkov, skip_entries,
                        skip_problems, token_problems, walk)


# ------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def rendered_text() -> str:
    return render_overlay(OVERLAY.name)


@pytest.fixture(scope="module")
def rendered(rendered_text) -> list[dict]:
    return [d for d in yaml.safe_load_all(rendered_text) if d is not None]


@pytest.fixture(scope="module")
def rendered_file(rendered_text, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("overlay") / "kind-cpu.rendered.yaml"
    path.write_text(rendered_text)
    return path


@pytest.fixture(scope="module")
def checkov_plain():
    return run_checkov("-d", "k8s")


@pytest.fixture(scope="module")
def checkov_overlay(rendered_file):
    return run_checkov("-f", str(rendered_file))


@pytest.fixture(scope="module")
def checkov_kuberay(tmp_path_factory):
    path = tmp_path_factory.mktemp("kuberay") / "kuberay-pods.yaml"
    path.write_text(yaml.safe_dump_all(kuberay_as_core_objects(), sort_keys=False))
    return run_checkov("-f", str(path))


# ------------------------------------------------------------------------------------- files


@pytest.mark.parametrize("path", ALL_YAML, ids=[rel(p) for p in ALL_YAML])
def test_every_file_is_one_resource_with_an_apply_check_logs_clean_header(path):
    objs = docs(path)
    assert len(objs) == 1, f"{rel(path)}: {len(objs)} documents; one main resource per file"
    assert {"apiVersion", "kind"} <= set(objs[0]), rel(path)
    assert header_problems(path) == []
    if path.name not in ("kustomization.yaml", "cluster.yaml"):  # names the tools expect
        assert re.fullmatch(rf"(\d\d-)?{objs[0]['kind'].lower()}\.[a-z0-9-]+\.yaml", path.name), \
            f"{rel(path)}: name it <kind>.<purpose>.yaml"


def test_the_plain_manifests_are_the_expected_objects_in_namespace_trainapp():
    objs = [d for p in PLAIN for d in docs(p)]
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == sorted([("Namespace", "trainapp"), ("ConfigMap", "trainapp-nccl"),
                            ("ConfigMap", "trainapp-config"), ("Deployment", "ray-head"),
                            ("Deployment", "ray-gpu-workers"), ("Service", "ray-head"),
                            ("NetworkPolicy", "ray"), ("PersistentVolumeClaim", RUNS_CLAIM),
                            ("ServiceAccount", "trainapp")])
    # `kubectl apply -f k8s/` goes in lexical order: the Namespace first; and no kustomization here.
    assert PLAIN[0].name.startswith("00-namespace.") and not (K8S / "kustomization.yaml").exists()
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "trainapp", f"{o['kind']}/{o['metadata']['name']}"
    for o in [*objs, load(RAYCLUSTER), load(RAYJOB)]:
        assert o["metadata"]["labels"].get("app.kubernetes.io/part-of") == "trainapp"
        version = [v for k, v in walk(o) if k == "app.kubernetes.io/version"]
        assert all(v == VERSION for v in version), f"{o['kind']}: version labels {version} != {VERSION}"


def test_core_objects_validate_strictly_against_kubernetes_1_32():
    core = [p for p in ALL_YAML if all(is_core(d) for d in docs(p))]
    assert set(PLAIN) <= set(core) and OVERLAY / "persistentvolume.runs-kind.yaml" in core
    assert kubernetes_validate_problems(core) == []


def test_every_image_is_the_projects_gpu_image():
    images = [(rel(p), v) for p in ALL_YAML for d in docs(p) for k, v in walk(d) if k == "image"]
    assert len(images) == 2 + 2 * 2 + 1, images  # head+workers; RayCluster and RayJob's cluster; submitter
    for where, image in images:
        # A registry prefix is the deployer's (k8s/README.md: push the image, point the manifests at it).
        name, _, tag = image.rpartition(":")
        assert name.rpartition("/")[2] == "trainapp" and tag == f"{VERSION}-gpu", f"{where}: {image}"


def test_no_token_or_secret_is_committed():
    assert token_problems(K8S) == []


def test_yamllint_strict_passes_on_k8s_ray_cluster_and_configs():
    yamllint = tool("yamllint")
    r = subprocess.run([str(yamllint), "-s", "-f", "parsable", "-c", str(REPO / ".yamllint"),
                        "k8s", "ray_cluster", "configs"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------------------- plain manifests


@pytest.mark.parametrize("pod", STATIC_PODS, ids=[p.where for p in STATIC_PODS])
def test_pod_template_is_locked_down_and_gets_the_token_from_the_secret(pod):
    assert pod_problems(pod) == []


def test_every_pod_template_is_checked():
    roles = sorted((p.where.split(":")[0], p.role) for p in STATIC_PODS)
    assert roles == [("k8s", "head"), ("k8s", "worker"), (RAYCLUSTER.name, "head"),
                     (RAYCLUSTER.name, "worker"), (RAYJOB.name, "head"), (RAYJOB.name, "submitter"),
                     (RAYJOB.name, "worker")]


def test_gpu_workers_ask_for_the_gpus_they_offer_ray():
    workers = load(K8S / "deployment.ray-gpu-workers.yaml")["spec"]["template"]["spec"]
    (c,) = workers["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--num-gpus=1" in c["args"]
    assert any(t["key"] == "nvidia.com/gpu" for t in workers["tolerations"])
    for spec in (load(RAYCLUSTER)["spec"], load(RAYJOB)["spec"]["rayClusterSpec"]):
        head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
        assert "nvidia.com/gpu" not in head["resources"]["limits"]
        for g in spec["workerGroupSpecs"]:
            limit = g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
            assert limit == int(g["rayStartParams"]["num-gpus"]) == 1, g["groupName"]


def test_service_reaches_the_heads_gcs_dashboard_and_client_ports():
    svc = load(K8S / "service.ray-head.yaml")["spec"]
    assert sorted(p["port"] for p in svc["ports"]) == [6379, 8265, 10001]
    assert svc.get("type", "ClusterIP") == "ClusterIP"
    head = load(K8S / "deployment.ray-head.yaml")["spec"]["template"]
    workers = load(K8S / "deployment.ray-gpu-workers.yaml")["spec"]["template"]
    named = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    for p in svc["ports"]:
        assert named.get(p["targetPort"]) == p["port"], \
            f"targetPort {p['targetPort']} is not the head's {p['port']}"
    selected = lambda labels: all(labels.get(k) == v for k, v in svc["selector"].items())  # noqa: E731
    assert selected(head["metadata"]["labels"]) and not selected(workers["metadata"]["labels"])


def test_network_policy_admits_only_pods_of_the_same_namespace_and_prometheus_to_the_metrics_port():
    spec = load(K8S / "networkpolicy.ray.yaml")["spec"]
    assert spec["podSelector"] == {} and spec["policyTypes"] == ["Ingress"]
    assert spec["ingress"], "an empty ingress list denies everything, including the workers"
    for rule in spec["ingress"]:
        assert rule.get("from"), "a rule without `from` admits every source"
        for peer in rule["from"]:
            if set(peer) != {"podSelector"}:  # another namespace: the metrics port only, nothing else
                assert (set(peer) == {"namespaceSelector"}
                        and rule.get("ports") == [{"port": 8080, "protocol": "TCP"}]), \
                    f"{peer}: namespaceSelector/ipBlock admit other namespaces"


@pytest.mark.parametrize("path", [K8S / "deployment.ray-head.yaml", K8S / "deployment.ray-gpu-workers.yaml",
                                  K8S / "kuberay" / "raycluster.gpu.yaml"])
def test_every_ray_pod_is_scraped_at_the_metrics_export_port_where_trainapps_live_metrics_are(path):
    text = path.read_text()
    templates = re.findall(r"prometheus.io/port: \"(\d+)\"", text)
    assert templates and set(templates) == {"8080"}, rel(path)
    assert "prometheus.io/scrape: \"true\"" in text
    if "kuberay" not in path.parts:  # KubeRay sets --metrics-export-port=8080 and the port itself
        assert "--metrics-export-port=8080" in text and "name: metrics" in text, rel(path)
    monitor = load(K8S / "monitoring" / "podmonitor.trainapp.yaml")
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_the_config_map_resolves_and_its_worker_range_fits_the_worker_replicas(tmp_path):
    config = load(K8S / "configmap.trainapp.yaml")["data"]["config.yaml"]
    ray = resolved_config(config, [], tmp_path)["ray"]
    replicas = load(K8S / "deployment.ray-gpu-workers.yaml")["spec"]["replicas"]
    assert ray["storage_path"] == RUNS_MOUNT
    most = max(ray["num_workers"]) if isinstance(ray["num_workers"], list) else ray["num_workers"]
    assert most == replicas, \
        f"ray.num_workers {ray['num_workers']}: the largest should be the {replicas} replicas"


# ------------------------------------------------------------------------------------- KubeRay


def test_kuberay_objects_are_ray_io_v1_with_the_ray_version_of_the_images():
    rc, rj = load(RAYCLUSTER), load(RAYJOB)
    assert (rc["apiVersion"], rc["kind"]) == ("ray.io/v1", "RayCluster")
    assert (rj["apiVersion"], rj["kind"]) == ("ray.io/v1", "RayJob")
    assert rc["spec"]["rayVersion"] == rj["spec"]["rayClusterSpec"]["rayVersion"] == ray_pin() == "2.60.0"
    assert rc["metadata"]["namespace"] == rj["metadata"]["namespace"] == "trainapp"


def test_rayjob_cluster_spec_is_the_rayclusters_spec():
    assert load(RAYJOB)["spec"]["rayClusterSpec"] == load(RAYCLUSTER)["spec"]


def test_rayjob_runs_the_ray_driver_with_the_worker_groups_elastic_range(tmp_path):
    spec = load(RAYJOB)["spec"]
    entrypoint = spec["entrypoint"]
    assert entrypoint.startswith("python -m trainapp ray "), entrypoint
    lo, hi = elastic_range(entrypoint)
    for g in spec["rayClusterSpec"]["workerGroupSpecs"]:
        assert (g["minReplicas"], g["maxReplicas"]) == (lo, hi), g["groupName"]
        assert lo <= g["replicas"] <= hi
    # The driver's --config is the ConfigMap mounted on the head, and the overrides resolve.
    words = shlex.split(entrypoint)
    config_path = Path(words[words.index("--config") + 1])
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mount = next(m for m in head["containers"][0]["volumeMounts"]
                 if m["mountPath"] == str(config_path.parent))
    volume = next(v for v in head["volumes"] if v["name"] == mount["name"])
    cm = load(K8S / "configmap.trainapp.yaml")
    assert volume["configMap"]["name"] == cm["metadata"]["name"] and config_path.name in cm["data"]
    ray = resolved_config(cm["data"][config_path.name], words[words.index("--config") + 2:], tmp_path)["ray"]
    assert ray["num_workers"] == [lo, hi] and ray["storage_path"] == RUNS_MOUNT


def test_rayjob_cleans_up_retries_and_leaves_the_interface_to_network_interface_auto():
    spec = load(RAYJOB)["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec.get("backoffLimit"), int) and spec["backoffLimit"] >= 0
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    nccl_map = K8S / "configmap.nccl.yaml"
    data = load(nccl_map)["data"]
    # Neither pins the interface, so trainapp's network.interface (auto) picks it in every pod.
    for var in IFNAME_VARS:
        assert var not in env, f"the RayJob's runtime env pins {var}: it would win over network.interface"
        assert var not in data, f"ConfigMap trainapp-nccl pins {var}: it would win over network.interface"
    # A deleted or suspended RayJob: the head's preStop stops the jobs (within the grace period) first.
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    stop = head["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert stop[:4] == ["python", "-m", "trainapp", "stop-jobs"], stop
    assert head["terminationGracePeriodSeconds"] > float(stop[stop.index("--wait-s") + 1])
    # The stop wait is the job's, not the pods' (docs/ray.md, "Stopping a run"): `ray job stop` reads it.
    from trainapp.launch.ray.stop import STOP_WAIT_S

    assert env.pop("RAY_JOB_STOP_WAIT_TIME_S") == str(STOP_WAIT_S)
    assert env and env == data, "runtime env and ConfigMap trainapp-nccl differ"
    # NCCL_DEBUG only: InfiniBand/RoCE stays on (NCCL_IB_DISABLE unset), no interface pinned.
    assert set(data) == {"NCCL_DEBUG"}, f"ConfigMap trainapp-nccl sets {sorted(data)}"
    # The overrides stay documented: commented out in the ConfigMap (and the RayJob), ready to uncomment.
    text = nccl_map.read_text()
    for var in IFNAME_VARS:
        assert re.search(rf"^ +# {var}: \S+$", text, re.M), f"{rel(nccl_map)}: no commented-out {var} example"
    for path in (nccl_map, RAYJOB):
        assert re.search(r'^ +# NCCL_IB_DISABLE: "1"$', path.read_text(), re.M), \
            (f"{rel(path)}: no commented-out NCCL_IB_DISABLE, the switch for clusters without working "
             f"InfiniBand/RoCE")


def test_no_uncommented_line_in_k8s_or_ray_cluster_pins_the_nccl_or_gloo_interface():
    assert any(p.is_relative_to(REPO / "ray_cluster") for p in PIN_SCANNED) and RAYJOB in PIN_SCANNED
    assert interface_pins(PIN_SCANNED) == []


def test_no_uncommented_line_in_k8s_or_ray_cluster_disables_infiniband():
    """NCCL_IB_DISABLE=1 forces TCP on RDMA-capable GPU nodes: it is the documented switch for clusters
    without working InfiniBand/RoCE (network.nccl or the ConfigMap), never a default of ours."""
    assert any(p.is_relative_to(OVERLAY) for p in PIN_SCANNED)  # the kind overlay is scanned too
    assert interface_pins(PIN_SCANNED, ("NCCL_IB_DISABLE",)) == []


# ------------------------------------------------------------------------------------- kind overlay


def test_overlay_lists_every_plain_manifest():
    resources = load(OVERLAY / "kustomization.yaml")["resources"]
    assert sorted(r for r in resources if r.startswith("../../")) == sorted(f"../../{p.name}" for p in PLAIN)
    assert (load(OVERLAY / "kustomization.yaml")["images"]
            == [{"name": "trainapp", "newTag": f"{VERSION}-cpu"}])


def test_overlay_renders_the_plain_objects_with_cpu_workers_and_a_kind_volume(rendered):
    plain = {(o["kind"], o["metadata"]["name"]) for p in PLAIN for o in docs(p)}
    want = plain - {("Deployment", "ray-gpu-workers")} | {("Deployment", "ray-cpu-workers"),
                                                          ("PersistentVolume", "trainapp-runs-kind")}
    assert {(o["kind"], o["metadata"]["name"]) for o in rendered} == want


def test_overlay_uses_the_loaded_cpu_image_and_no_gpu(rendered, rendered_text):
    containers = [c for d in by_kind(rendered, "Deployment").values()
                  for c in d["spec"]["template"]["spec"]["containers"]]
    assert len(containers) == 2
    for c in containers:
        assert c["image"] == CPU_IMAGE and c["imagePullPolicy"] == "Never", c["name"]
    assert "nvidia.com/gpu" not in rendered_text and "--num-gpus" not in rendered_text


def test_overlay_runs_one_head_and_two_workers(rendered, tmp_path):
    deployments = by_kind(rendered, "Deployment")
    assert deployments["ray-head"]["spec"]["replicas"] == 1
    assert deployments["ray-cpu-workers"]["spec"]["replicas"] == 2
    config = by_kind(rendered, "ConfigMap")["trainapp-config"]["data"]["config.yaml"]
    ray = resolved_config(config, [], tmp_path)["ray"]
    assert ray["num_workers"] == 2 and ray["storage_path"] == RUNS_MOUNT


def test_both_kind_overlays_run_the_cpu_config_not_the_gpu_one(rendered, tmp_path):
    """The KubeRay overlay's 1-CPU pods of 3 GiB too: the GPU ConfigMap's run (resnet18, a batch of 256 and 4
    DataLoader processes per worker) took a container smoke's worker pod there within reach of Ray's memory
    monitor (bench/results/ci_tiers.json, container_smoke_kuberay_memory; a CI run failed on it)."""
    kuberay = [d for d in yaml.safe_load_all(render_overlay("kind-cpu-kuberay")) if d is not None]
    config = by_kind(rendered, "ConfigMap")["trainapp-config"]["data"]["config.yaml"]
    assert by_kind(kuberay, "ConfigMap")["trainapp-config"]["data"]["config.yaml"] == config
    cpu = resolved_config(config, [], tmp_path)
    gpu = yaml.safe_load(load(K8S / "configmap.trainapp.yaml")["data"]["config.yaml"])
    assert cpu["model"]["name"] == "smallcnn" != gpu["model"]["name"]
    assert cpu["data"]["num_workers"] == 0 < gpu["data"]["num_workers"]
    assert cpu["train"]["batch_size"] < gpu["train"]["batch_size"]


def test_overlay_claim_binds_by_name_to_the_host_path_volume_on_every_kind_node(rendered):
    (pvc,) = by_kind(rendered, "PersistentVolumeClaim").values()
    (pv,) = by_kind(rendered, "PersistentVolume").values()
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pvc["spec"]["storageClassName"] == pv["spec"]["storageClassName"] == ""
    assert pv["spec"]["claimRef"] == {"namespace": pvc["metadata"]["namespace"],
                                      "name": pvc["metadata"]["name"]}
    assert pvc["spec"]["accessModes"] == pv["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pv["spec"]["capacity"]["storage"] == pvc["spec"]["resources"]["requests"]["storage"]
    nodes = load(KIND_CLUSTER)["nodes"]
    assert len(nodes) == 3 and all(
        any(m["containerPath"] == pv["spec"]["hostPath"]["path"] for m in n.get("extraMounts", []))
        for n in nodes)


def test_overlay_pod_templates_are_locked_down_too(rendered):
    pods = pods_of(rendered, "overlay")
    assert sorted(p.role for p in pods) == ["head", "worker"]
    assert [msg for p in pods for msg in pod_problems(p)] == []


def test_overlay_validates_strictly_against_kubernetes_1_32(rendered_file):
    assert kubernetes_validate_problems([rendered_file]) == []


# ------------------------------------------------------------------------------------- checkov


def test_checkov_passes_the_plain_manifests(checkov_plain):
    # `-d k8s` also reads k8s/kuberay/ (0 resources: checkov skips custom resources) and the overlay folder.
    assert checkov_problems(checkov_plain, {"Deployment.trainapp.ray-head",
                                            "Deployment.trainapp.ray-gpu-workers",
                                            "Service.trainapp.ray-head"}) == []


def test_checkov_passes_the_rendered_overlay(checkov_overlay):
    assert checkov_problems(checkov_overlay, {"Deployment.trainapp.ray-head",
                                              "Deployment.trainapp.ray-cpu-workers"}) == []


def test_checkov_passes_the_kuberay_pod_templates(checkov_kuberay):
    expect = {"Pod.trainapp.trainapp-gpu-head", "Pod.trainapp.trainapp-gpu-worker-gpu",
              "Pod.trainapp.trainapp-train-head", "Pod.trainapp.trainapp-train-worker-gpu",
              "Job.trainapp.trainapp-train-submitter"}
    assert checkov_problems(checkov_kuberay, expect) == []


def test_checkov_skips_are_annotations_with_a_reviewed_id_and_a_reason():
    entries = [e for p in ALL_YAML for e in skip_entries(docs(p), rel(p))]
    assert entries, "no skips found: did the annotations move?"
    assert skip_problems(entries) == []
    # Only annotations: checkov has no inline-comment skips for Kubernetes YAML.
    for p in ALL_YAML:
        assert "checkov:skip" not in p.read_text(), f"{rel(p)}: use a checkov.io/skipN annotation"


def test_rendered_overlay_skips_are_reviewed_too(rendered):
    entries = skip_entries(rendered, "overlay")
    assert {v.partition("=")[0] for _, _, v in entries} == ALLOWED_CHECKOV_SKIPS
    assert skip_problems(entries) == []


# ------------------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("pod", WORKER_PODS, ids=[p.where for p in WORKER_PODS])
def test_worker_pod_drains_on_deletion_within_its_grace_period(pod):
    cm = load(K8S / "configmap.trainapp.yaml")["data"]["config.yaml"]
    grace_s = config_grace_s(cm, rayjob_overrides() if pod.where.startswith(RAYJOB.name) else [])
    assert preemption_problems(pod, grace_s) == []


def test_overlay_worker_pod_drains_on_deletion_within_its_grace_period(rendered):
    workers = [p for p in pods_of(rendered, "overlay") if p.role == "worker"]
    assert len(workers) == 1
    grace_s = config_grace_s(by_kind(rendered, "ConfigMap")["trainapp-config"]["data"]["config.yaml"])
    assert preemption_problems(workers[0], grace_s) == []


def test_every_worker_pod_template_is_checked_for_preemption():
    assert sorted(p.where.split(":")[0] for p in WORKER_PODS) == sorted(["k8s", RAYCLUSTER.name, RAYJOB.name])


def test_the_run_configs_set_preempt_grace_s_explicitly(rendered, tmp_path):
    """Not left to the default: the drain wait in the manifests is tuned against this number."""
    configs = {"configmap": load(K8S / "configmap.trainapp.yaml")["data"]["config.yaml"],
               "overlay": by_kind(rendered, "ConfigMap")["trainapp-config"]["data"]["config.yaml"]}
    for where, text in configs.items():
        assert "grace_s" in (yaml.safe_load(text).get("preempt") or {}), \
            f"{where}: preempt.grace_s is not set"
        resolved = resolved_config(text, [], tmp_path)["preempt"]["grace_s"]
        assert resolved == config_grace_s(text) < 30, f"{where}: preempt.grace_s {resolved}"


# ------------------------------------------------------------------------------------- the checks can fail


def _head_pod() -> Pod:
    return copy.deepcopy(pods_of(docs(K8S / "deployment.ray-head.yaml"), "copy")[0])


def _break_pod(change: Callable[[dict], None]) -> Callable[[Path], list[str]]:
    def run(tmp: Path) -> list[str]:
        pod = _head_pod()
        change(pod.spec)
        return pod_problems(pod)
    return run


def _break_worker(change: Callable[[dict], None]) -> Callable[[Path], list[str]]:
    def run(tmp: Path) -> list[str]:
        pod = copy.deepcopy(pods_of(docs(K8S / "deployment.ray-gpu-workers.yaml"), "copy")[0])
        change(pod.spec)
        return preemption_problems(pod, 25.0)
    return run


def _set_flag(words: list[str], flag: str, value: str) -> None:
    words[words.index(flag) + 1] = value


def _prestop(spec: dict) -> list[str]:
    return spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]


def _env(spec: dict, name: str) -> dict:
    return next(e for e in spec["containers"][0]["env"] if e["name"] == name)


def _checkov_without_container_security_context(tmp: Path) -> list[str]:
    obj = load(K8S / "deployment.ray-head.yaml")
    del obj["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    (tmp / "deployment.broken.yaml").write_text(yaml.safe_dump(obj, sort_keys=False))
    return checkov_problems(run_checkov("-f", str(tmp / "deployment.broken.yaml")),
                            {"Deployment.trainapp.ray-head"})


def _validate_unknown_field(tmp: Path) -> list[str]:
    obj = load(K8S / "service.ray-head.yaml")
    obj["spec"]["ports"][0]["targetport"] = 6379  # a typo kubectl would drop silently
    (tmp / "service.broken.yaml").write_text(yaml.safe_dump(obj))
    return kubernetes_validate_problems([tmp / "service.broken.yaml"])


def _header_without_clean(tmp: Path) -> list[str]:
    text = (K8S / "service.ray-head.yaml").read_text()
    path = tmp / "service.ray-head.yaml"
    path.write_text("\n".join(line for line in text.splitlines() if not line.startswith("# Clean:")))
    return header_problems(path)


def _token_in_a_manifest(tmp: Path) -> list[str]:
    shutil.copytree(K8S, tmp / "k8s")
    with open(tmp / "k8s" / "deployment.ray-head.yaml", "a") as f:
        f.write(f"# token: {secrets.token_hex(32)}\n")
    return token_problems(tmp / "k8s")


def _interface_pinned_again(tmp: Path) -> list[str]:
    text = (K8S / "configmap.nccl.yaml").read_text()
    path = tmp / "configmap.nccl.yaml"
    path.write_text(text.replace("  # GLOO_SOCKET_IFNAME: eth0", "  GLOO_SOCKET_IFNAME: eth0"))
    return interface_pins([path])


def _unreviewed_and_unexplained_skips(tmp: Path) -> list[str]:
    obj = load(K8S / "deployment.ray-head.yaml")
    obj["metadata"]["annotations"].update({"checkov.io/skip8": "CKV_K8S_16=",
                                           "checkov.io/skip9": "CKV_K8S_16=privileged, for no good reason"})
    return skip_problems(skip_entries([obj], "copy"))


@pytest.mark.parametrize("breaks, expect", [
    (_checkov_without_container_security_context, "FAILED CKV_K8S_20"),
    (_validate_unknown_field, "did not validate"),
    (_header_without_clean, "the header lacks ['# Clean:']"),
    (_token_in_a_manifest, "a 64-hex-digit string"),
    (_interface_pinned_again, "sets GLOO_SOCKET_IFNAME"),
    (_unreviewed_and_unexplained_skips, "CKV_K8S_16 without a reason"),
    (_unreviewed_and_unexplained_skips, "CKV_K8S_16 is not in ALLOWED_CHECKOV_SKIPS"),
    (_break_pod(lambda s: s["securityContext"].pop("runAsNonRoot")), "runAsNonRoot is not true"),
    (_break_pod(lambda s: s["containers"][0]["securityContext"]["capabilities"].update(drop=["NET_RAW"])),
     "capabilities.drop lacks ALL"),
    (_break_pod(lambda s: s["containers"][0]["resources"].pop("limits")), "resources.limits lacks"),
    (_break_pod(lambda s: s["containers"][0].pop("livenessProbe")), "no livenessProbe"),
    (_break_pod(lambda s: _env(s, "RAY_AUTH_TOKEN").update(value="x" * 64)),
     "RAY_AUTH_TOKEN does not come from"),
    (_break_pod(lambda s: s["volumes"][0]["emptyDir"].pop("medium")), "/dev/shm is not an emptyDir"),
    (_break_pod(lambda s: s["volumes"].pop(2)), f"the claim {RUNS_CLAIM} is not mounted"),
    (_break_worker(lambda s: s["containers"][0].pop("lifecycle")), "preStop does not run"),
    (_break_worker(lambda s: s.pop("terminationGracePeriodSeconds")), "no terminationGracePeriodSeconds"),
    (_break_worker(lambda s: _set_flag(_prestop(s), "--wait-s", "20")), "is not above preempt.grace_s"),
    (_break_worker(lambda s: s.update(terminationGracePeriodSeconds=30)),
     "exceeds terminationGracePeriodSeconds"),
    (_break_worker(lambda s: _set_flag(_prestop(s), "--ray-deadline-s", "60")),
     "is not terminationGracePeriodSeconds"),
    (_break_worker(lambda s: _prestop(s).remove("--ray-deadline-s")), "--ray-deadline-s given 0 times"),
    (_break_worker(lambda s: _set_flag(s["containers"][0]["command"], "--wait-s", "31")),
     "differs from the preStop"),
    (_break_worker(lambda s: s["containers"][0].update(command=["ray"])),
     "not wrapped in `python -m trainapp node"),
    (_break_worker(lambda s: s["containers"][0]["args"].remove("--block")),
     "does not run `ray start ... --block`"),
], ids=["checkov", "kubernetes-validate", "header", "token", "interface-pin", "skip-reason", "skip-review",
        "pod-root", "capabilities", "limits", "probe", "token-literal", "shm-on-disk", "runs-not-mounted",
        "no-prestop", "no-grace-period", "drain-wait-short", "grace-period-short", "ray-deadline",
        "prestop-flag", "node-wait", "unwrapped", "no-block"])
def test_the_checks_catch_a_broken_copy(breaks, expect, tmp_path):
    problems = breaks(tmp_path)
    assert any(expect in msg for msg in problems), problems
