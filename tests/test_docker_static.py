"""Static checks of docker/Dockerfile and .dockerignore (no Docker engine needed): hadolint, checkov,
and the layout the Kubernetes/KubeRay manifests rely on."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass, field

import pytest
import tomllib
from helpers import PY, REPO, tool

from trainapp.launch.ray import checks

DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
EXAMPLE_DOCKERFILE = REPO / "examples" / "tabular" / "Dockerfile"  # a user's task added to the image
TARGETS = ("gpu", "cpu")
# Checks skipped inline in docker/Dockerfile, each beside the instruction it concerns, with a reason.
# A new skip must be added here too, so that it is reviewed.
ALLOWED_CHECKOV_SKIPS = {"CKV_DOCKER_2", "CKV_DOCKER_7"}
OCI_LABELS = ("title", "description", "version", "source", "revision", "licenses")
# The GPU target's torch index: PyTorch's index of the CUDA flavour the TORCH_CUDA build argument names.
TORCH_CUDA_INDEX = "https://download.pytorch.org/whl/${TORCH_CUDA}"


# ------------------------------------------------------------------------------------- a tiny parser


@dataclass
class Instr:
    cmd: str  # upper case: FROM, RUN, ...
    args: str  # continuation lines joined, comment lines removed
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instrs: list[Instr] = field(default_factory=list)


def parse(text: str) -> tuple[list[Instr], list[Stage]]:
    """Instructions before the first FROM, and the stages (Dockerfile syntax: `\\` continues a line,
    a line starting with `#` is a comment, also inside a continued instruction)."""
    instrs: list[Instr] = []
    buf: list[str] = []
    start = 0
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        if not buf:
            start = n
        if line.rstrip().endswith("\\"):
            buf.append(line.rstrip()[:-1])
            continue
        buf.append(line)
        joined = "".join(buf).strip()
        buf = []
        cmd, _, args = joined.partition(" ")
        instrs.append(Instr(cmd.upper(), args.strip(), start))
    assert not buf, "Dockerfile ends inside a continued instruction"
    header: list[Instr] = []
    stages: list[Stage] = []
    for ins in instrs:
        if ins.cmd == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            assert len(words) in (1, 3), f"line {ins.line}: FROM {ins.args!r}"
            stages.append(Stage(words[0], name))
        elif stages:
            stages[-1].instrs.append(ins)
        else:
            header.append(ins)
    return header, stages


def pairs(args: str) -> dict[str, str]:
    """KEY=VALUE pairs of ENV/LABEL/ARG (also the old `ENV KEY value` form)."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])} if len(words) > 1 else {words[0]: None}
    return dict(w.split("=", 1) for w in words)


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str | None], dict[str, Stage]]:
    header, stages = parse(DOCKERFILE.read_text())
    assert all(i.cmd == "ARG" for i in header), [i.cmd for i in header]
    global_args: dict[str, str | None] = {}
    for ins in header:
        global_args.update(pairs(ins.args))
    names = [s.name for s in stages]
    assert len(names) == len(set(names)), f"stage names are not unique: {names}"
    return global_args, {s.name: s for s in stages}


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, root first."""
    out = [stages[name]]
    while out[0].base in stages:
        out.insert(0, stages[out[0].base])
    return out


def effective(stages: dict[str, Stage], name: str, cmd: str) -> dict[str, str | None]:
    merged: dict[str, str | None] = {}
    for stage in chain(stages, name):
        for ins in stage.instrs:
            if ins.cmd == cmd:
                merged.update(pairs(ins.args))
    return merged


def last(stages: dict[str, Stage], name: str, cmd: str) -> Instr | None:
    found = [i for s in chain(stages, name) for i in s.instrs if i.cmd == cmd]
    return found[-1] if found else None


def pyproject() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def pinned(dist: str) -> str:
    """The exact version pyproject.toml pins for `dist` (`name==X` or `name[extras]==X`)."""
    for dep in pyproject()["project"]["dependencies"]:
        m = re.fullmatch(rf"{re.escape(dist)}(\[[^\]]*\])?==([^\s;,]+)", dep.strip())
        if m:
            return m.group(2)
    raise AssertionError(f"pyproject.toml does not pin {dist} exactly")


# ------------------------------------------------------------------------------------- linters


@pytest.mark.parametrize("path", [DOCKERFILE, EXAMPLE_DOCKERFILE], ids=["docker", "example"])
def test_hadolint_reports_nothing_at_warning_or_above(path):
    hadolint = tool("hadolint")
    r = subprocess.run([str(hadolint), "--no-color", "--failure-threshold", "warning", "-f", "json",
                        str(path)], capture_output=True, text=True, timeout=120)
    findings = json.loads(r.stdout or "[]")
    bad = [f for f in findings if f["level"] in ("error", "warning")]
    assert r.returncode == 0 and not bad, f"rc={r.returncode} {bad or r.stderr}"


def test_checkov_reports_no_failed_check():
    checkov = tool("checkov")
    r = subprocess.run([str(checkov), "-f", str(DOCKERFILE), "--framework", "dockerfile", "--quiet",
                        "--compact", "-o", "json", "--skip-download"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    reports = json.loads(r.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert reports and all(rep.get("check_type") == "dockerfile" for rep in reports), r.stdout[:2000]
    for rep in reports:
        summary = rep["summary"]
        failed = [(c["check_id"], c["check_name"], c.get("file_line_range"))
                  for c in rep["results"].get("failed_checks", [])]
        assert summary["failed"] == 0 and not failed, failed
        assert summary["parsing_errors"] == 0 and summary["passed"] > 0, summary
    assert r.returncode == 0, r.stderr[-2000:]


def test_inline_skips_are_few_known_and_give_a_reason():
    lines = DOCKERFILE.read_text().splitlines()
    skips = {}
    for n, line in enumerate(lines):
        m = re.match(r"\s*#\s*checkov:skip=([A-Z0-9_]+)(.*)", line)
        if m:
            reason = m.group(2).lstrip(":").strip()
            assert len(reason) > 15, f"line {n + 1}: checkov skip of {m.group(1)} without a reason"
            skips[m.group(1)] = reason
        if re.match(r"\s*#\s*hadolint\s+ignore=", line):
            assert n > 0 and lines[n - 1].lstrip().startswith("#") and "hadolint" not in lines[n - 1], \
                f"line {n + 1}: a hadolint ignore needs a comment with its reason on the line before"
            assert not lines[n + 1].lstrip().startswith("#"), \
                f"line {n + 1}: ignore must precede an instruction"
    assert set(skips) <= ALLOWED_CHECKOV_SKIPS, \
        f"new checkov skips to review: {set(skips) - ALLOWED_CHECKOV_SKIPS}"


def test_every_run_is_valid_shell(dockerfile):
    _, stages = dockerfile
    for stage in stages.values():
        for ins in stage.instrs:
            if ins.cmd == "RUN":
                assert not ins.args.startswith("["), f"line {ins.line}: exec-form RUN has no shell"
                r = subprocess.run(["sh", "-n", "-c", ins.args], capture_output=True, text=True)
                assert r.returncode == 0, f"line {ins.line}: {r.stderr}"
                if "apt-get install" in ins.args:  # hadolint rates these two as info only
                    assert "apt-get install -y --no-install-recommends" in ins.args, f"line {ins.line}"
                    assert "rm -rf /var/lib/apt/lists/*" in ins.args, f"line {ins.line}: apt lists stay"


# ------------------------------------------------------------------------------------- structure


def test_both_targets_exist_and_share_one_layout(dockerfile):
    _, stages = dockerfile
    assert set(TARGETS) <= set(stages), f"targets missing: {set(TARGETS) - set(stages)}"
    bodies = {}
    for target in TARGETS:
        instrs = stages[target].instrs
        first_run = next(i for i, ins in enumerate(instrs) if ins.cmd == "RUN")
        preamble = {ins.cmd for ins in instrs[:first_run]}
        assert preamble <= {"ARG", "LABEL"}, f"{target}: only ARG/LABEL may differ before the layout"
        bodies[target] = [(ins.cmd, ins.args) for ins in instrs[first_run:]]
    assert bodies["gpu"] == bodies["cpu"], "the gpu and cpu targets must repeat the same layout block"
    # ... and the last stage of the file is one of the targets, so a plain `docker build` gets an image.
    assert list(stages)[-1] in TARGETS


def test_every_from_uses_an_arg_with_a_pinned_default(dockerfile):
    args, stages = dockerfile
    roots = set()
    for stage in stages.values():
        if stage.base in stages:
            continue  # FROM an earlier stage
        m = re.fullmatch(r"\$\{?([A-Z0-9_]+)\}?", stage.base)
        assert m, f"FROM {stage.base} ({stage.name}): base images come from build ARGs"
        default = args.get(m.group(1))
        assert default, f"ARG {m.group(1)} needs a default before the first FROM"
        repo, sep, tag = default.rpartition(":")
        assert sep and "/" not in tag and tag and tag != "latest", f"{m.group(1)}={default}: pin a full tag"
        assert re.search(r"\d+\.\d+", tag), f"{m.group(1)}={default}: tag should carry a full version"
        roots.add(m.group(1))
    assert {"GPU_BASE", "CPU_BASE"} <= roots
    assert chain(stages, "gpu")[0].base == "${GPU_BASE}" and chain(stages, "cpu")[0].base == "${CPU_BASE}"


def test_gpu_target_pins_torch_to_a_cuda_flavour_and_starts_from_no_cuda_image(dockerfile):
    """torch's CUDA wheels bring their own CUDA runtime, cuDNN and NCCL (nvidia-* packages): the flavour
    is chosen by TORCH_CUDA, through its index, and the base adds no second CUDA. The node's driver is
    mounted by the NVIDIA container toolkit, which the two NVIDIA_* variables ask for."""
    args, stages = dockerfile
    declared = effective(stages, "gpu", "ARG")
    flavour = declared.get("TORCH_CUDA")
    assert flavour and re.fullmatch(r"cu1[2-9]\d", flavour), \
        f"gpu: ARG TORCH_CUDA={flavour!r}: pin a CUDA flavour"
    assert flavour == "cu130", \
        "the default is the CUDA 13.0 build (docker/README.md states its driver and GPUs)"
    assert declared["TORCH_INDEX_URL"] == TORCH_CUDA_INDEX, declared["TORCH_INDEX_URL"]
    assert TORCH_CUDA_INDEX.replace("${TORCH_CUDA}", flavour).endswith(f"/whl/{flavour}")
    torch_install = [i.args for i in stages["gpu"].instrs
                     if i.cmd == "RUN" and '"torch==${TORCH_VERSION}"' in i.args]
    assert torch_install and torch_install[0].startswith('pip install --index-url "${TORCH_INDEX_URL:-'), \
        "the first torch install must read TORCH_INDEX_URL, or the flavour pin does not reach pip"
    # No CUDA base image anywhere in the GPU chain: every root is a build ARG whose default is checked.
    for stage in chain(stages, "gpu"):
        base = args.get(stage.base.strip("${}"), stage.base)
        assert base and "cuda" not in base.lower() and not base.startswith("nvcr.io/"), \
            f"FROM {stage.base} ({base}) in the gpu chain: the torch wheels carry CUDA; use a plain base"
    assert args["GPU_BASE"] == args["CPU_BASE"], "one Python for both images: the CPU target's base"
    env = effective(stages, "gpu", "ENV")
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "all", env
    assert set(env.get("NVIDIA_DRIVER_CAPABILITIES", "").split(",")) >= {"compute", "utility"}, env
    assert "/usr/local/nvidia/lib64" in env.get("LD_LIBRARY_PATH", "").split(":"), \
        "GKE mounts the driver there"
    assert "NVIDIA_VISIBLE_DEVICES" not in effective(stages, "cpu", "ENV")
    # NCCL loads the verbs libraries itself: without them it uses TCP sockets even on InfiniBand/RoCE.
    runs = " ".join(i.args for s in chain(stages, "gpu") for i in s.instrs if i.cmd == "RUN")
    assert "libibverbs1" in runs and "ibverbs-providers" in runs, "gpu: rdma-core's verbs libraries for NCCL"


def test_version_args_equal_the_pins_in_pyproject(dockerfile):
    args, stages = dockerfile
    assert args["TORCH_VERSION"] == pinned("torch")
    assert args["TORCHVISION_VERSION"] == pinned("torchvision")
    # Ray: any of the supported range (build with RAY_VERSION=your cluster's); the default is the newest.
    assert checks.check_version(args["RAY_VERSION"]) == args["RAY_VERSION"] == checks.NEWEST_TESTED
    assert args["APP_VERSION"] == pyproject()["project"]["version"]
    for target in TARGETS:
        runs = " ".join(i.args for i in stages[target].instrs if i.cmd == "RUN")
        declared = effective(stages, target, "ARG")
        for arg, use in (("TORCH_VERSION", '"torch==${TORCH_VERSION}"'),
                         ("TORCHVISION_VERSION", '"torchvision==${TORCHVISION_VERSION}"'),
                         ("RAY_VERSION", '"ray[default,train]==${RAY_VERSION}"')):
            assert arg in declared and use in runs, f"{target}: {arg} is not what pip installs"
        assert "pip install --no-deps --no-build-isolation ." in runs


def test_package_sources_are_args_without_machine_specific_defaults(dockerfile):
    args, stages = dockerfile
    for target in TARGETS:
        declared = effective(stages, target, "ARG")
        for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
            assert name in declared and not declared[name], f"{target}: ARG {name} must default to empty"
        assert "TORCH_INDEX_URL" in declared
    assert effective(stages, "cpu", "ARG")["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert effective(stages, "gpu", "ARG")["TORCH_INDEX_URL"] == TORCH_CUDA_INDEX  # the flavour's index
    text = DOCKERFILE.read_text()
    for bad in ("127.0.0.1", "localhost", "/work/", "/root/", "file://", "--trusted-host",
                "PIP_TRUSTED_HOST"):
        assert bad not in "\n".join(line for line in text.splitlines()
                                    if not line.lstrip().startswith("#")), bad


def test_final_stages_run_as_numeric_non_root_with_the_venv_first_on_path(dockerfile):
    _, stages = dockerfile
    for target in TARGETS:
        user = last(stages, target, "USER")
        assert user is not None, f"{target}: no USER"
        m = re.fullmatch(r"(\d+)(?::(\d+))?", user.args)
        assert m and int(m.group(1)) != 0, f"{target}: USER {user.args} must be a numeric non-root uid"
        assert int(m.group(1)) == 1000 and m.group(2) in (None, "1000")
        # Nothing runs as root after the USER switch that the image's user could not undo.
        after = stages[target].instrs[stages[target].instrs.index(user):]
        assert not [i for i in after if i.cmd in ("RUN", "COPY", "ADD")], f"{target}: build steps after USER"

        env = effective(stages, target, "ENV")
        assert env.get("PYTHONUNBUFFERED") == "1" and env.get("PIP_NO_CACHE_DIR") == "1", env
        assert env.get("PATH", "").startswith("/opt/venv/bin:"), env.get("PATH")
        runs = " ".join(i.args for s in chain(stages, target) for i in s.instrs if i.cmd == "RUN")
        assert "python3 -m venv /opt/venv" in runs
        assert "useradd --uid 1000 --gid 1000" in runs
        assert re.search(r"install -d [^;&]*-o 1000 -g 1000 [^;&]*/home/trainapp/runs", runs), \
            "a writable /home/trainapp/runs owned by uid 1000"
        assert "iproute2" in runs, f"{target}: iproute2 (`ip`) must be installed or present"
        copies = [i.args for i in stages[target].instrs if i.cmd == "COPY"]
        assert "docker/venv-path.sh /etc/profile.d/trainapp-venv.sh" in copies, \
            "login shells need the venv too"

        workdir = last(stages, target, "WORKDIR")
        assert workdir and workdir.args == "/home/trainapp/app"
        cmd = last(stages, target, "CMD")
        assert cmd and json.loads(cmd.args)[:3] == ["python", "-m", "trainapp"], "exec-form CMD"


def test_the_example_adds_a_task_to_the_image_and_changes_nothing_else():
    """examples/tabular/Dockerfile, the `FROM` docs/your-own-model.md documents: it copies what exists,
    as the image's user, onto the PYTHONPATH it sets, and neither runs nor switches anything."""
    _, (stage,) = parse(EXAMPLE_DOCKERFILE.read_text())
    copies = [i.args.split() for i in stage.instrs if i.cmd == "COPY"]
    assert copies and all(c[0] == "--chown=1000:1000" and (EXAMPLE_DOCKERFILE.parent / c[1]).exists()
                          for c in copies)
    env = [i.args for i in stage.instrs if i.cmd == "ENV"]
    assert (env == ["PYTHONPATH=/home/trainapp/tasks"]
            and all(c[2].startswith("/home/trainapp/tasks/") for c in copies))
    assert {i.cmd for i in stage.instrs} <= {"COPY", "ENV"}


def test_oci_labels(dockerfile):
    _, stages = dockerfile
    for target in TARGETS:
        labels = effective(stages, target, "LABEL")
        for key in OCI_LABELS:
            assert f"org.opencontainers.image.{key}" in labels, f"{target}: label {key} missing"
        assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
        assert labels["org.opencontainers.image.title"] == "trainapp"
        assert labels["org.opencontainers.image.version"] == "${APP_VERSION}"
        assert target.upper() in labels["org.opencontainers.image.description"].upper()


def test_login_shells_get_the_venv_first_on_path():
    """KubeRay starts `ray start` through `bash -l`, whose /etc/profile resets PATH on Debian/Ubuntu."""
    script = REPO / "docker" / "venv-path.sh"
    for start in ("/usr/local/bin:/usr/bin:/bin", "/opt/venv/bin:/usr/bin:/bin"):
        r = subprocess.run(["sh", "-c", f'. "{script}"; . "{script}"; printf %s "$PATH"'],
                           env={"PATH": start}, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("/opt/venv/bin:") and r.stdout.count("/opt/venv/bin") == 1, r.stdout


def test_requirements_snippet_reads_pyproject():
    """The RUN that installs trainapp's dependencies prints build requirements and dependencies."""
    run = next(i.args for s in parse(DOCKERFILE.read_text())[1] for i in s.instrs
               if i.cmd == "RUN" and "tomllib" in i.args)
    command = re.search(r'python (-c "[^"]+")', run).group(1)  # run through sh, as the build does
    r = subprocess.run(["sh", "-c", f'"$0" {command}', PY], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    proj = pyproject()
    assert lines == [*proj["build-system"]["requires"], *proj["project"]["dependencies"]]


# ------------------------------------------------------------------------------------- .dockerignore


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides; `!` re-includes."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").strip().strip("/")
        rx = ""
        i = 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif pat.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif pat[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif pat[i] == "?":
                rx, i = rx + "[^/]", i + 1
            elif pat[i] == "[":
                j = pat.index("]", i)
                rx, i = rx + pat[i:j + 1], j + 1
            else:
                rx, i = rx + re.escape(pat[i]), i + 1
        if any(re.fullmatch(rx, p) for p in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_secrets_and_local_state_out_but_the_image_inputs_in(dockerfile):
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    for path in (".git/HEAD", ".venv/bin/python", ".venv-tools/bin/checkov", "runs/r1/metrics.jsonl",
                 "data/train/a.png", "trainapp/__pycache__/cli.cpython-311.pyc", ".pytest_cache/v",
                 "trainapp.egg-info/PKG-INFO"):
        assert dockerignore_excludes(path, patterns), f".dockerignore lets {path} into the build context"
    _, stages = dockerfile
    sources = {src for s in stages.values() for i in s.instrs if i.cmd == "COPY"
               for src in shlex.split(i.args)[:-1] if not src.startswith("--")}
    assert {"pyproject.toml", "README.md", "trainapp/", "configs/"} <= sources
    for src in sorted(sources):
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
        files = [src] if (REPO / src).is_file() else \
            [p.relative_to(REPO).as_posix() for p in (REPO / src).rglob("*")
             if p.is_file() and "__pycache__" not in p.parts]
        assert files, src
        for f in files:
            assert not dockerignore_excludes(f, patterns), f".dockerignore drops {f}, which COPY {src} needs"
