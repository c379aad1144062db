"""Static checks of the Ray cluster launcher configs in ray_cluster/ (no cluster, cloud or Docker needed):
Ray's own schema and config preparation, the pinned image, the Docker options (no pinned network
interface), the head's start command, worker counts, and no secrets."""

from __future__ import annotations

import copy
import json
import pathlib
import re
import shlex

import jsonschema
import pytest
import ray
import tomllib
import yaml
from helpers import REPO
from ray.autoscaler._private.docker import docker_start_cmds
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_DIR = REPO / "ray_cluster"
CONFIGS = sorted(CLUSTER_DIR.glob("*.yaml"))
SCHEMA = pathlib.Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
TOKEN_LIKE = re.compile(r"(?<![0-9A-Fa-f])[0-9A-Fa-f]{64}(?![0-9A-Fa-f])")


def load(path: pathlib.Path) -> dict:
    return yaml.safe_load(path.read_text())


def ids(paths: list[pathlib.Path]) -> list[str]:
    return [p.name for p in paths]


def by_provider(kind: str) -> list[pathlib.Path]:
    return [p for p in CONFIGS if load(p)["provider"]["type"] == kind]


def docker_options(config: dict, role: str) -> list[str]:
    """The options `docker run` gets on a head or worker node, split into words."""
    docker = config["docker"]
    joined = " ".join(docker.get("run_options", []) + docker.get(f"{role}_run_options", []))
    return shlex.split(joined)


def env_of(options: list[str]) -> dict[str, str]:
    env = {}
    for flag, value in zip(options, options[1:]):
        if flag in ("-e", "--env"):
            key, _, val = value.partition("=")
            env[key] = val
    return env


def start_args(commands: list[str]) -> list[str]:
    """Words of the `ray start` command among start commands (the one after `ray stop`)."""
    starts = [c for c in commands if "ray start" in c]
    assert len(starts) == 1, commands
    assert commands.index(starts[0]) > 0 and commands[0].strip() == "ray stop", commands
    return shlex.split(starts[0])


def test_the_expected_configs_exist():
    assert {p.name for p in CONFIGS} >= {"local.gpu.yaml", "aws.gpu.yaml"}
    assert {load(p)["provider"]["type"] for p in CONFIGS} >= {"local", "aws"}


# --------------------------------------------------------------------------- Ray's schema and code


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_validates_against_rays_schema(path):
    config = load(path)
    assert isinstance(config, dict)
    if config["provider"]["type"] == "local":
        # The one key outside the schema that Ray accepts: for "local", `ray up` moves a top-level
        # min_workers into the node type before validating (ray/autoscaler/_private/local/config.py).
        config.pop("min_workers", None)
    jsonschema.validate(config, json.loads(SCHEMA.read_text()))


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_rays_config_preparation_accepts_it(path):
    """What `ray up` does before it talks to the provider: merge the provider's defaults, normalize
    node types, then validate (schema plus cross-field checks such as min/max workers)."""
    prepared = prepare_config(copy.deepcopy(load(path)))
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("path", by_provider("local"), ids=ids(by_provider("local")))
def test_local_bootstrap_accepts_it(path):
    """For the provider "local", all of `ray up`'s config bootstrap runs offline (no cache written)."""
    from ray.autoscaler._private.commands import _bootstrap_config

    resolved = _bootstrap_config(copy.deepcopy(load(path)), no_config_cache=True)
    validate_config(resolved)


# Not tested here: `ray up`'s AWS bootstrap (instance-type lookup, IAM role, key pair, security group,
# subnets) calls the EC2 and IAM APIs and needs AWS credentials and a network; prepare_config and
# validate_config above cover everything of it that runs offline.


# --------------------------------------------------------------------------------------- the image


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_image_is_pinned_to_the_trainapp_version(path):
    config = load(path)
    docker = config["docker"]
    images = [docker[k] for k in ("image", "head_image", "worker_image") if k in docker]
    images += [t["docker"]["worker_image"] for t in config.get("available_node_types", {}).values()
               if "worker_image" in t.get("docker", {})]
    assert images, "no docker image"
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"{image}: no tag"
        assert "latest" not in tag, f"{image}: not pinned"
        assert tag == f"{VERSION}-gpu", f"{image}: tag must be {VERSION}-gpu (pyproject.toml's version)"
        assert name.rsplit("/", 1)[-1] == "trainapp", image
    assert docker["container_name"] and docker["pull_before_run"] is True


# ----------------------------------------------------------------------------------- Docker options


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_docker_options(path):
    config = load(path)
    for role in ("head", "worker"):
        opts = docker_options(config, role)
        assert any(o.startswith("--shm-size") for o in opts), f"{role}: no --shm-size"
        assert "memlock=-1" in opts, f"{role}: no --ulimit memlock=-1"
        env = env_of(opts)
        # No interface pinned: set here it would win over trainapp's network.interface (auto picks,
        # per node, the interface routing to the head; the host's names vary under --net=host).
        pinned = {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} & set(env)
        assert not pinned, f"{role}: {sorted(pinned)} pinned; leave the choice to network.interface=auto"
        # InfiniBand/RoCE stays NCCL's choice (sockets where the node has none); NCCL_IB_DISABLE=1 is
        # the switch for clusters where it does not work, commented out in the config.
        assert "NCCL_IB_DISABLE" not in env, \
            f"{role}: NCCL_IB_DISABLE set; it forces TCP on RDMA-capable nodes"
        assert env.get("NCCL_DEBUG"), role
        assert env.get("RAY_AUTH_MODE") == "token", role
        assert "RAY_AUTH_TOKEN" not in env, f"{role}: a token in the config; use RAY_AUTH_TOKEN_PATH"
        assert env.get("RAY_AUTH_TOKEN_PATH"), role
        assert "/mnt/runs:/mnt/runs" in opts, f"{role}: no shared storage mount"
    # Workers get the GPUs; a CPU-only head would refuse --gpus.
    worker = docker_options(config, "worker")
    assert worker[worker.index("--gpus") + 1] == "all"


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_host_networking_exactly_once(path):
    """Ray's launcher adds --net=host to every `docker run`; Docker refuses a second network option."""
    config = load(path)
    docker = config["docker"]
    for role in ("head", "worker"):
        opts = docker_options(config, role)
        assert not [o for o in opts if o.startswith(("--net", "--network"))], \
            f"{role}: Ray adds --net=host itself; a second network option makes `docker run` fail"
        command = docker_start_cmds("user", docker["image"], config.get("file_mounts", {}),
                                    docker["container_name"], docker.get("run_options", [])
                                    + docker.get(f"{role}_run_options", []), config["cluster_name"],
                                    "/home/trainapp", "docker")
        words = shlex.split(command.replace("$(id -g)", "1000"))
        network = [w for w in words if w.startswith(("--net", "--network"))]
        assert network == ["--net=host"], command


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_token_comes_from_a_file_mount(path):
    config = load(path)
    token_path = env_of(docker_options(config, "head"))["RAY_AUTH_TOKEN_PATH"]
    mounts = config.get("file_mounts", {})
    remote = [r for r in mounts if token_path.startswith(r.rstrip("/") + "/")]
    assert remote, f"RAY_AUTH_TOKEN_PATH={token_path} is not inside any file_mounts path"
    local = mounts[remote[0]]
    assert local.startswith("~/") or local.startswith("/"), \
        f"{local}: the token directory must be outside the repository (an absolute or ~ path)"


# ------------------------------------------------------------------------------- start commands


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_head_start_command(path):
    args = start_args(load(path)["head_start_ray_commands"])
    assert "--head" in args and "--port=6379" in args and "--dashboard-host=0.0.0.0" in args
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in args, "no autoscaler on the head"
    system = [a.split("=", 1)[1] for a in args if a.startswith("--system-config=")]
    assert len(system) == 1, args
    assert json.loads(system[0]) == HEALTH_CHECK


@pytest.mark.parametrize("path", CONFIGS, ids=ids(CONFIGS))
def test_worker_start_command(path):
    args = start_args(load(path)["worker_start_ray_commands"])
    assert "--address=$RAY_HEAD_IP:6379" in args


# ----------------------------------------------------------------------------- nodes and workers


@pytest.mark.parametrize("path", by_provider("local"), ids=ids(by_provider("local")))
def test_local_worker_counts_match_the_worker_ips(path):
    config = load(path)
    provider = config["provider"]
    n = len(provider["worker_ips"])
    assert provider["head_ip"] and n >= 1 and provider["head_ip"] not in provider["worker_ips"]
    lo, hi = config.get("min_workers", n), config.get("max_workers", n)
    assert 0 <= lo <= hi == n
    assert config["auth"]["ssh_user"] and config["auth"]["ssh_private_key"]
    prepared = prepare_config(copy.deepcopy(config))
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == n
    # The head trains nothing: no task CPUs or GPUs, like the AWS head's CPU: 0.
    args = start_args(config["head_start_ray_commands"])
    assert "--num-cpus=0" in args and "--num-gpus=0" in args


@pytest.mark.parametrize("path", by_provider("aws"), ids=ids(by_provider("aws")))
def test_aws_node_types(path):
    config = load(path)
    assert config["provider"].get("region") and config["provider"].get("availability_zone")
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("CPU") == 0, "training must not land on the head"
    assert not head["resources"].get("GPU")
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    assert workers
    for name, t in workers.items():
        assert t["resources"].get("GPU", 0) >= 1, f"{name}: no GPU resource"
        assert 0 <= t["min_workers"] <= t["max_workers"] <= config["max_workers"], name
        assert t["node_config"]["InstanceType"] and t["node_config"].get("ImageId"), name
    assert sum(t.get("min_workers", 0) for t in types.values()) <= config["max_workers"]
    assert config["idle_timeout_minutes"] > 0
    # The shared storage is mounted on the instance before Docker starts.
    assert any("/mnt/runs" in c for c in config["initialization_commands"])


# ------------------------------------------------------------------------------------------ secrets


@pytest.mark.parametrize("path", sorted(p for p in CLUSTER_DIR.rglob("*") if p.is_file()),
                         ids=lambda p: str(p.relative_to(CLUSTER_DIR)))
def test_no_token_in_any_file(path):
    text = path.read_text(errors="replace")
    found = TOKEN_LIKE.findall(text)
    assert not found, f"{path.name} holds something that looks like a token: {found[0][:8]}..."
    assert not re.search(r"RAY_AUTH_TOKEN=(?!\$)\S", text), f"{path.name} sets RAY_AUTH_TOKEN to a value"
