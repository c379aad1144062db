"""scripts/container_smoke.py without a Docker engine: missing prerequisites and bad settings end with
exit 2 and a summary line naming what is missing, before anything is built or started; and the
docker/kind parts of scripts/smoke_assert.py it relies on (docker cp, the non-root check), run
against fake `docker` and `kubectl` commands. The smoke test itself (minutes, root, a real dockerd)
runs from .ci/run as `make container-smoke`, not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, render_overlay
from test_smoke_assert import TOTAL, smoke_assert, write_run

SCRIPT = REPO / "scripts" / "container_smoke.py"

# A stand-in for `docker` / `kubectl`: `exec NAME ... python3 -I -c CODE` prints the processes of
# FAKE_PROCS[NAME] (uid 0 for names containing "root"); `cp NAME:SRC DEST` copies FAKE_RUNS/basename;
# `version` fails (no engine) unless FAKE_ENGINE is set; anything else exits 1.
FAKE_CLI = r"""
import json, os, shutil, sys
args = sys.argv[1:]
while args and args[0] in ("--context", "-n"):
    args = args[2:]
if args[:1] == ["exec"]:
    name = args[1]
    if "missing" in name:
        sys.exit("Error: No such container: " + name)
    uid = 0 if "root" in name else 1000
    print(json.dumps([{"pid": 1, "uid": uid, "euid": uid, "cmd": "ray start --block"},
                      {"pid": 7, "uid": 1000, "euid": 1000, "cmd": "python3 -I -c ..."}]))
elif args[:1] == ["cp"]:
    src = args[1].split(":", 1)[1]
    shutil.copytree(os.path.join(os.environ["FAKE_RUNS"], os.path.basename(src)), args[2])
elif args[:2] == ["get", "pod"]:
    print("ray-head-0 ray-worker-0")
elif args[:1] == ["version"] and os.environ.get("FAKE_ENGINE"):
    print("20.10.24")
else:
    sys.exit(1)
"""


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("docker", "kubectl", "ray"):
        p = bin_dir / name
        p.write_text(f"#!{sys.executable}\n{FAKE_CLI}")
        p.chmod(0o755)
    return bin_dir


def smoke(env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run([sys.executable, str(SCRIPT)], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)


def last_line(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r.stdout.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------- the driver


def test_a_missing_ray_cli_exits_2_naming_it(tmp_path):
    r = smoke({"RAY": str(tmp_path / "no-ray")})
    assert r.returncode == 2
    assert "Ray CLI" in last_line(r) and "make venv" in last_line(r)


def test_a_missing_docker_cli_exits_2_naming_it(tmp_path, fake_bin):
    r = smoke({"RAY": str(fake_bin / "ray"), "DOCKER": str(tmp_path / "no-docker"),
               "SMOKE_TMPDIR": str(tmp_path)})
    assert r.returncode == 2
    assert "docker CLI" in last_line(r) and "apt-get install -y docker.io" in last_line(r)


@pytest.mark.parametrize("value", ["abc", "0", "-5"])
def test_a_bad_timeout_exits_2_naming_the_setting(tmp_path, fake_bin, value):
    r = smoke({"RAY": str(fake_bin / "ray"), "TIMEOUT": value})
    assert r.returncode == 2
    assert f"TIMEOUT='{value}'" in last_line(r)


@pytest.mark.skipif(os.geteuid() != 0, reason="as another user the root check comes first")
def test_without_dockerd_it_exits_2_before_starting_anything(tmp_path, fake_bin):
    # PATH has the fake docker and ray only: no dockerd, containerd or debootstrap.
    r = smoke({"PATH": str(fake_bin), "RAY": str(fake_bin / "ray"), "SMOKE_TMPDIR": str(tmp_path / "t")})
    assert r.returncode == 2
    assert "dockerd not found" in last_line(r) and "docker.io" in last_line(r)
    assert not (tmp_path / "t").exists() or not any((tmp_path / "t").iterdir())


def test_an_engine_that_does_not_answer_exits_2_and_leaves_no_temporary_directory(tmp_path, fake_bin):
    r = smoke({"PATH": f"{fake_bin}:{os.environ['PATH']}", "RAY": str(fake_bin / "ray"),
               "SMOKE_DOCKER_HOST": "unix:///nonexistent.sock", "SKIP_BUILD": "1",
               "SMOKE_TMPDIR": str(tmp_path / "t")})
    assert r.returncode == 2
    assert "SMOKE_DOCKER_HOST=unix:///nonexistent.sock: no Docker engine answers there" in last_line(r)
    assert list((tmp_path / "t").iterdir()) == []


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("      serviceAccountName: trainapp\n      terminationGracePeriodSeconds: 45\n",
     "      serviceAccountName: trainapp\n      terminationGracePeriodSeconds: 45\n"
     "      hostNetwork: true\n",
     "k8s/deployment.ray-gpu-workers.yaml, renamed ray-cpu-workers by k8s/overlays/kind-cpu "
     "Deployment/ray-cpu-workers: spec.template.spec.hostNetwork is not implemented by the container "
     "smoke's pod runner"),
    ("        name: ray-head\n        ports:\n",
     "        name: ray-head\n        stdin: true\n        ports:\n",
     "k8s/deployment.ray-head.yaml Deployment/ray-head: spec.template.spec.containers[0].stdin is not "
     "implemented"),
])
def test_a_rendered_manifest_with_a_field_the_runner_lacks_fails_the_smoke_in_one_line(
        tmp_path, fake_bin, old, new, expected):
    rendered = render_overlay("kind-cpu")
    assert old in rendered
    (tmp_path / "rendered.yaml").write_text(rendered.replace(old, new))
    r = smoke({"PATH": f"{fake_bin}:{os.environ['PATH']}", "RAY": str(fake_bin / "ray"), "FAKE_ENGINE": "1",
               "SMOKE_DOCKER_HOST": "unix:///fake.sock", "SKIP_BUILD": "1",
               "SMOKE_TMPDIR": str(tmp_path / "t"),
               "SMOKE_RENDERED_FILE": str(tmp_path / "rendered.yaml")})
    assert r.returncode == 1, r.stdout + r.stderr
    assert last_line(r).startswith("container-smoke: FAIL in ") and expected in last_line(r), last_line(r)
    assert list((tmp_path / "t").iterdir()) == []


# ----------------------------------------------------------------- smoke_assert: docker and non-root


def test_docker_backend_copies_the_run_out_of_the_container_and_checks_it(tmp_path, fake_bin, monkeypatch,
                                                                          capsys):
    write_run(tmp_path / "volume" / "smoke", [(None, 25), (20, TOTAL)])
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_RUNS", str(tmp_path / "volume"))
    rc = smoke_assert.main(["/mnt/runs/smoke", "--docker-container", "head", "--dest", str(tmp_path / "copy"),
                            "--nonroot", "head", "--nonroot", "worker-1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "copied /mnt/runs/smoke from container head" in out
    assert "PASS non-root: 4 processes in 2 containers (head, worker-1), uid(s) [1000]" in out


def test_a_root_process_fails_non_root_naming_the_container(tmp_path, fake_bin, monkeypatch, capsys):
    run = write_run(tmp_path / "run", [(None, 25), (20, TOTAL)])
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    assert smoke_assert.main([str(run), "--nonroot", "head", "--nonroot", "worker-as-root"]) == 1
    out = capsys.readouterr().out
    assert "FAIL non-root: worker-as-root: 1 process(es) as root, e.g. pid 1 'ray start --block'" in out
    assert "smoke_assert: FAIL 1 of 6 checks (non-root)" in out


def test_a_container_that_cannot_be_listed_fails_non_root(tmp_path, fake_bin, monkeypatch, capsys):
    run = write_run(tmp_path / "run", [(None, 25), (20, TOTAL)])
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    assert smoke_assert.main([str(run), "--nonroot", "missing-one"]) == 1
    assert ("FAIL non-root: missing-one: cannot list processes "
            "(exit 1: Error: No such container: missing-one)" in capsys.readouterr().out)


def test_kind_backend_checks_every_pod_of_the_selector(tmp_path, fake_bin, monkeypatch, capsys):
    good = write_run(tmp_path / "pod" / "smoke", [(None, 25), (20, TOTAL)])
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    monkeypatch.setattr(smoke_assert, "fetch_kind", lambda *a: good)
    rc = smoke_assert.main(["/mnt/runs/smoke", "--backend", "kind", "--context", "kind-x", "--dest",
                            str(tmp_path), "--nonroot-selector", "app.kubernetes.io/name=trainapp"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS non-root: 4 processes in 2 containers (ray-head-0, ray-worker-0)" in out


def test_the_process_lister_reads_this_machine(tmp_path):
    """PROCESS_LISTER is what runs inside the containers: here it runs on the host, as an empty exec
    prefix."""
    procs = smoke_assert.list_processes([])
    assert any(p["pid"] == os.getpid() and p["uid"] == os.getuid() for p in procs)
    assert json.loads(json.dumps(procs)) == procs
