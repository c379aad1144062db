"""Ray's private API is used in one folder, trainapp/launch/ray/private/, one module per job: the test walks
it. Every private name its modules list imports on the installed Ray, each module lists every private name its
code uses, no other module of trainapp reaches into Ray's private modules, and a Ray outside the supported
range stops the Ray driver with one line naming the range."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import tomllib
from helpers import REPO

from trainapp.config import ConfigError
from trainapp.launch.ray import checks, private
from trainapp.launch.ray.private import backend, controller, trainer

FENCE = REPO / "trainapp" / "launch" / "ray" / "private"
MODULES = [importlib.import_module(f"{private.__name__}.{m.name}")
           for m in pkgutil.iter_modules(private.__path__)]
"""Every module of the fence, found by walking its folder (the package's __init__ is not one: it names no
Ray)."""


def _short(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[1]


NAMES = [(_short(m), module, name) for m in MODULES for module, name in getattr(m, "PRIVATE_NAMES", ())]


@pytest.mark.parametrize("where, module, name", NAMES, ids=[f"{w}:{n}" for w, _, n in NAMES])
def test_every_private_ray_name_imports_on_the_installed_ray(where, module, name):
    assert hasattr(importlib.import_module(module), name), \
        f"{module}.{name} is gone: update trainapp/launch/ray/private/{where}.py"


def test_the_fence_is_the_folder_and_every_module_in_it_lists_its_private_names():
    assert (sorted(_short(m) for m in MODULES)
            == sorted(p.stem for p in FENCE.glob("*.py") if p.stem != "__init__"))
    unlisted = [_short(m) for m in MODULES if not isinstance(getattr(m, "PRIVATE_NAMES", None), tuple)]
    assert not unlisted, unlisted
    assert all(len(entry) == 2 and all(isinstance(p, str) for p in entry)
               for m in MODULES for entry in (*m.PRIVATE_NAMES, *getattr(m, "OPTIONAL_NAMES", ()))), \
        "(module, name)"


def _private(module: str, name: str = "") -> bool:
    """A part of the path starts with "_" (`ray.__version__` is public)."""
    return any(p.startswith("_") and not p.startswith("__") for p in [*module.split("."), name])


RAY_PATH = re.compile(r"ray(\.\w+)+")
LISTS = {"PRIVATE_NAMES", "OPTIONAL_NAMES"}


def private_names_used(path: Path) -> tuple[set[str], set[tuple[str, str]]]:
    """The private Ray modules the code of `path` names, and the (module, name) pairs it takes from Ray where
    the module or the name is private (a part that starts with "_"): `from M import N`, `import M`,
    `ray.M.N`, a Ray module written as a string (or a module constant bound to one) and the string name
    after it in a call (`_in_worker(M, N)`, `_attr(M, N)`). Docstrings and `if TYPE_CHECKING:` blocks are
    left out: prose, and names for typing only, which mypy checks."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip |= {id(n) for n in ast.walk(node)}
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))
        elif isinstance(node, ast.Assign) and {getattr(t, "id", None) for t in node.targets} & LISTS:
            skip |= {id(n) for n in ast.walk(node)}  # the lists themselves
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            skip.add(id(node.value))  # `ray.a._b.c` is one path, not three
    bound = {t.id: n.value.value
             for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
             for t in n.targets if isinstance(t, ast.Name)}

    def ray_path(node: ast.AST) -> str | None:
        value = bound.get(node.id) if isinstance(node, ast.Name) else getattr(node, "value", None)
        return value if isinstance(value, str) and RAY_PATH.fullmatch(value) else None

    def dotted(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return node.id
        head = dotted(node.value) if isinstance(node, ast.Attribute) else None
        return f"{head}.{node.attr}" if head else None

    modules, pairs = set(), set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ray":
            pairs |= {(node.module, a.name) for a in node.names if _private(node.module, a.name)}
        elif isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if a.name.split(".")[0] == "ray" and _private(a.name)}
        elif isinstance(node, ast.Constant) and ray_path(node) and _private(node.value):
            modules.add(node.value)
        elif isinstance(node, ast.Call):
            for m, n in zip(node.args, node.args[1:]):
                module, name = ray_path(m), n.value if isinstance(n, ast.Constant) else None
                if module and isinstance(name, str) and _private(module, name):
                    pairs.add((module, name))
        elif (isinstance(node, ast.Attribute) and (path := dotted(node)) and path.startswith("ray.")
              and _private(path)):
            pairs.add(tuple(path.rsplit(".", 1)))
    return modules, pairs


@pytest.mark.parametrize("module", [private, *MODULES], ids=["__init__", *(_short(m) for m in MODULES)])
def test_every_private_name_a_module_of_the_fence_uses_is_in_its_list_and_every_one_listed_is_used(module):
    listed = {entry for name in LISTS for entry in getattr(module, name, ())}
    modules, pairs = private_names_used(Path(module.__file__))
    assert pairs <= listed, f"used, not in PRIVATE_NAMES: {sorted(pairs - listed)}"
    assert modules <= {m for m, _ in listed}, \
        f"used, no name of it listed: {sorted(modules - {m for m, _ in listed})}"
    # A name the scan would find (private, not an attribute of a class) that it does not: listed, no longer
    # used.
    stale = {(m, n) for m, n in listed if _private(m, n) and "." not in n} - pairs
    assert not stale, f"listed, not used: {sorted(stale)}"


def test_the_scan_for_private_names_finds_each_way_a_module_writes_one(tmp_path):
    """The scan is the check above: it must find a private name however the fence writes it, and nothing in
    prose, in a typing-only block or in the lists themselves."""
    source = tmp_path / "fence.py"
    source.write_text('''"""Prose: ray.train._internal.session, from ray._private import worker."""
from typing import TYPE_CHECKING
import ray._private.services
from ray.train import _bar, report
from ray.train.v2._internal.constants import FOO
if TYPE_CHECKING:
    from ray.train._internal.base_worker_group import BaseWorkerGroup
_M = "ray.train.v2._internal.thing"
PRIVATE_NAMES = (("ray.train.v2._internal.listed", "Z"),)
"""The list: ray.train.v2._internal.prose."""
X = ray._private.worker._global_node
call(_M, "NAME")
call(ray.__version__, "ray.util", "_hidden")
''')
    modules, pairs = private_names_used(source)
    assert modules == {"ray._private.services", "ray.train.v2._internal.thing"}
    assert pairs == {("ray.train", "_bar"), ("ray.train.v2._internal.constants", "FOO"),
                     ("ray._private.worker", "_global_node"), ("ray.train.v2._internal.thing", "NAME"),
                     ("ray.util", "_hidden")}


def test_the_backend_config_stands_in_for_rays_torch_config():
    # TorchConfigWithSetup re-drives Ray's torch backend from a torch-free module: a field or default
    # Ray adds or changes, or a backend that stops sharing the node's GPUs, must be seen here.
    from ray.train.torch import TorchConfig

    assert {f.name for f in dataclasses.fields(TorchConfig)} == {"backend", "init_method", "timeout_s"}
    ours = backend.TorchConfigWithSetup()
    assert (TorchConfig().init_method, TorchConfig().timeout_s) == ("env", ours.timeout_s)
    assert TorchConfig().backend_cls.share_cuda_visible_devices == ours.backend_cls.share_cuda_visible_devices
    assert ours.framework == TorchConfig().framework
    assert ours.to_dict() == {**TorchConfig(timeout_s=ours.timeout_s).to_dict(), "backend": None}
    # The context around the training function is Ray's, entered in the worker.
    entered = []
    ray_cm = TorchConfig().train_func_context
    original = ray_cm.__enter__
    ray_cm.__enter__ = lambda self: entered.append(type(self))
    try:
        with ours.train_func_context():
            pass
    finally:
        ray_cm.__enter__ = original
    assert entered == [ray_cm]


def test_the_trainer_is_rays_torch_trainer_made_from_its_base_class():
    # Ray's TorchTrainer adds to DataParallelTrainer only its constructor (the backend's choice) and a
    # local mode; a method Ray adds there would be missing from trainapp's and is seen here.
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    own = {n for n in vars(TorchTrainer)
           if n not in ("__doc__", "__module__") and not n.startswith("_annotated")}
    assert own == {"__init__", "_get_local_controller"}
    assert issubclass(trainer.TorchTrainer, DataParallelTrainer)
    for use_gpu, chosen in ((False, "gloo"), (True, "nccl")):
        scaling = ScalingConfig(num_workers=2, use_gpu=use_gpu)
        ours = trainer.TorchTrainer(lambda config: None, scaling_config=scaling)
        theirs = TorchTrainer(lambda config: None, scaling_config=scaling)
        assert ours.backend_config.backend == theirs.backend_config.backend == chosen


def test_the_callback_hooks_node_loss_watch_and_resize_snapshot_override_still_exist():
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    for cls, hook in ((ControllerCallback, "before_controller_execute_failure_decision"),
                      (ControllerCallback, "before_controller_execute_resize_decision"),
                      (WorkerGroupCallback, "after_worker_group_start"),
                      (WorkerGroupCallback, "after_worker_group_poll_status"),
                      (WorkerGroupCallback, "before_worker_group_shutdown"),
                      (WorkerGroupCallback, "before_worker_group_abort")):
        assert callable(getattr(cls, hook, None)), hook


# What each supported Ray offers of the optional hooks (trainapp/launch/ray/private/versions.py), looked up
# in the Ray wheels' sources: (drain notices, re-read on request, the coordinator's tick).
OFFERS = {(2, 55): (False, False, True), (2, 56): (False, False, True), (2, 57): (False, False, True),
          (2, 58): (True, False, True), (2, 59): (True, False, True), (2, 60): (True, True, True)}


def test_the_optional_hooks_found_are_those_the_installed_ray_is_known_to_offer():
    import ray

    from trainapp.launch.ray.private import versions

    minor = tuple(int(p) for p in ray.__version__.split(".")[:2])
    assert (versions.drain_notices(), versions.RECOMPUTE, versions.TICK) == OFFERS[minor], ray.__version__
    assert versions.RESERVED_CACHE_S > 0 and versions.cluster_reread()
    lost = versions.lost(drains=True, elastic=True)
    assert (len(lost) == (not OFFERS[minor][0])
            and all(line.startswith(f"ray {ray.__version__}: ") for line in lost))
    assert sorted(OFFERS) == [(2, m) for m in range(int(checks.SUPPORTED[0].split(".")[1]),
                                                    int(checks.SUPPORTED[1].split(".")[1]))]


def test_the_controllers_environment_names_the_drain_watch_interval_only_where_ray_has_it():
    from trainapp.launch.ray.private import versions

    env = controller.controller_env(60.0, 0.25)
    assert ((versions.PREEMPTION_POLL_INTERVAL_S_ENV_VAR in env)
            == (versions.PREEMPTION_POLL_INTERVAL_S_ENV_VAR is not None))
    assert all(isinstance(k, str) and k.startswith("RAY_TRAIN_") for k in env)


PRIVATE = re.compile(r"\bray(\.\w+)*\.(_\w+)|from ray[\w.]* import .*\b_[A-Za-z]\w*")


def test_no_other_trainapp_module_touches_rays_private_api():
    offenders = []
    for path in sorted((REPO / "trainapp").rglob("*.py")):
        if FENCE in path.parents:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if PRIVATE.search(code):
                offenders.append(f"{path.name}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_pyproject_admits_exactly_the_supported_range_and_the_tested_rays_are_in_it():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    ray = next(d for d in deps if d.startswith("ray["))
    assert ray == f"ray[default,train]>={checks.SUPPORTED[0]},<{checks.SUPPORTED[1]}", ray
    for version in (checks.NEWEST_TESTED, checks.OLDEST_TESTED):
        assert checks.check_version(version) == version
    with pytest.raises(ConfigError):
        checks.check_version(checks.UNSUPPORTED_TESTED)


@pytest.mark.parametrize("version", ["2.54.1", "2.61.0", "3.0.0"])
def test_a_ray_outside_the_range_is_refused_naming_the_range(version):
    with pytest.raises(ConfigError, match=rf"ray {re.escape(version)}: .*Ray >=2\.55\.0,<2\.61\.0"):
        checks.check_version(version)


@pytest.mark.parametrize("version", ["2.55.0", "2.57.1", "2.60.0", "2.60.3"])
def test_every_ray_of_the_six_latest_minor_releases_is_accepted(version):
    assert checks.check_version(version) == version


def test_the_ray_driver_on_another_ray_exits_2_with_one_line(tmp_path):
    # The installed version as Ray reports it is replaced before trainapp asks; nothing else changes.
    code = ("import importlib.metadata as m, sys; real = m.version; "
            "m.version = lambda name: '2.61.0' if name == 'ray' else real(name); "
            "from trainapp.cli import main; "
            "sys.exit(main(['ray', 'ray.storage_path=" + str(tmp_path) + "']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "ray 2.61.0:" in lines[0] and ">=2.55.0,<2.61.0" in lines[0], r.stderr


DRIVER = ("from trainapp.launch.ray import driver, setup; from trainapp.launch.ray.private import trainer; "
          "trainer.TorchTrainer(setup.train_worker, "
          "torch_config=driver._torch_config(driver.Config(), 1, setup.train_worker))")
CONTROLLER = "import " + ", ".join([m.__name__ for m in MODULES] + ["trainapp.launch.ray.resize"])
"""Every module of the fence (what the controller unpickles, the backend config and the callbacks, among
them), and the resize callback's."""


@pytest.mark.parametrize("statement, absent", [
    # Each probe task unpickles trainapp.launch.ray.checks on its node: a torch import there costs seconds
    # of CPU per node at every launch (and the driver imports Ray Train while the probes start).
    ("import trainapp.launch.ray.checks", ("torch", "ray", "ray.train")),
    # Every process of a job with spares imports the setup hook's module (trainapp/launch/ray/spares.py).
    ("import trainapp.launch.ray.spares", ("torch", "ray", "trainapp.config")),
    # Ray Train's controller unpickles the backend config (private/backend.py) with its setup function
    # (setup.py) and the controller callbacks: it trains nothing and must not pay torch's import.
    (CONTROLLER, ("torch",)),
    ("import trainapp.launch.ray.setup", ("torch",)),
    # The driver builds the trainer and hands Ray the per-worker function: torch is the workers' alone.
    (DRIVER, ("torch",)),
], ids=["probes", "hook", "controller", "setup", "driver"])
def test_what_the_probes_the_controller_and_the_driver_run_imports_no_torch(statement, absent):
    code = f"import sys; {statement}; print(sorted(m for m in {absent!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_module_a_worker_imports_while_the_group_forms_exists():
    # prepare_worker's thread swallows an import error (the worker function's own import reports it):
    # a renamed module would silently import nothing early.
    from trainapp.launch.ray import setup

    assert set(setup.IMPORTS) == {setup.train_worker, setup.comm_worker}
    for names in setup.IMPORTS.values():
        for name in names:
            importlib.import_module(name)


def test_the_trainer_drops_ray_datas_callback_only_for_a_run_without_datasets():
    """Without datasets Ray Train would still start a DatasetManager actor at every worker-group
    start; trainapp's runs have none. A run that is given datasets keeps the callback."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    def names(made):
        return [type(cb) for cb in made._create_default_callbacks()]

    lean = names(trainer.TorchTrainer(lambda config: None))
    assert DatasetsCallback not in lean and len(lean) >= 3  # the backend, PG cleaner, ... are kept
    assert DatasetsCallback in names(trainer.TorchTrainer(lambda config: None,
                                                          datasets={"train": lambda: None}))


def test_the_private_hooks_of_a_stop_are_where_the_fence_expects_them():
    """trainapp/launch/ray/stop.py: the driver's Ctrl-C goes through Ray Train's own SIGINT hook, and a
    killed run's resource request is found by Ray Train's requester id."""
    import inspect

    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        _AutoscalingCoordinatorActor,
    )
    from ray.train.v2._internal.execution.scaling_policy.scaling_policy import ScalingPolicy

    assert callable(getattr(trainer.DataParallelTrainer, "_register_sigint_handler", None))
    assert 'f"train-{train_run_context.run_id}"' in inspect.getsource(ScalingPolicy.after_controller_start)
    assert "requester_id" in inspect.signature(_AutoscalingCoordinatorActor.cancel_request).parameters


@pytest.mark.skipif(not os.environ.get("TRAINAPP_RAY_UNSUPPORTED_PYTHON"),
                    reason="needs a Ray installed below the range: make test-ray-oldest installs one")
def test_a_driver_on_a_real_ray_below_the_range_exits_2_with_one_line(tmp_path):
    py = os.environ["TRAINAPP_RAY_UNSUPPORTED_PYTHON"]
    version = subprocess.run([py, "-c", "import ray; print(ray.__version__)"], capture_output=True, text=True,
                             timeout=120).stdout.strip()
    assert version == checks.UNSUPPORTED_TESTED
    r = subprocess.run([py, "-m", "trainapp", "ray", f"ray.storage_path={tmp_path}"], cwd=REPO,
                       capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stdout + r.stderr
    assert f"ray {version}:" in lines[0] and f">={checks.SUPPORTED[0]},<{checks.SUPPORTED[1]}" in lines[0]


def test_the_docs_state_the_supported_range_with_a_column_per_minor_release():
    text = (REPO / "docs" / "ray.md").read_text()
    lo, hi = (tuple(int(p) for p in v.split(".")[:2]) for v in checks.SUPPORTED)
    minors = [f"{lo[0]}.{m}" for m in range(lo[1], hi[1])]
    assert f"`>={checks.SUPPORTED[0]},<{checks.SUPPORTED[1]}`" in text
    assert f"**{minors[0]} to {minors[-1]}**" in text
    header = next(line for line in text.splitlines() if line.startswith("| feature |"))
    assert [c.strip() for c in header.strip("|").split("|")][1:-1] == minors, header
