"""The package stays easy to change: small modules with one job each (a function's size is ruff's to
gate, in branches, arguments and statements: pyproject.toml, `make lint`), and an architecture the tree
shows: subsystem packages that import only the layers below them, no import
cycle (function-level imports included), no mutable module-global state, one `os._exit`, and failure
metadata carried by types, not looked up by `getattr`."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "trainapp"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES = 500
LAYERS = ("errors", "startup", "config", "group", "streams", "tasks", "observe", "snapshots", "weights",
          "faults", "core", "launch", "tools", "cli", "api", "__main__")
"""trainapp's subsystems from the bottom up: a module imports its own layer and the layers below it only."""


def _name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


NAMES = {_name(p): p for p in MODULES}


def _imports(path: Path) -> set[str]:
    """The trainapp modules `path` imports anywhere (module level or inside a function)."""
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("trainapp")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainapp"):
            for a in node.names:  # `from trainapp.core import data` names a module; `import Config` a name
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in NAMES else node.module)
    return {m for m in out if m in NAMES and m != _name(path)}


def _layer(module: str) -> int:
    parts = module.split(".")
    # trainapp/__init__.py: the package's doc, and the public entry points (trainapp/api.py) on demand
    return LAYERS.index(parts[1]) if len(parts) > 1 else LAYERS.index("api")


def test_no_module_in_trainapp_is_longer_than_500_lines():
    long = [f"{p.name} ({n} lines)" for p in MODULES
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, long


def test_no_test_file_is_longer_than_600_lines():
    """A test file is split by what it checks before it grows past 600 lines (shared checkers and helpers
    live in tests/helpers.py, tests/conftest.py or a module of their own, such as tests/k8s_checks.py)."""
    long = [f"{p.name} ({n} lines)" for p in sorted((REPO / "tests").glob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600]
    assert not long, long


def test_every_module_says_what_it_is_for():
    missing = [str(p.relative_to(REPO)) for p in MODULES if not ast.get_docstring(_tree(p))]
    assert not missing, missing


def test_every_module_belongs_to_a_subsystem_and_imports_only_its_layer_and_those_below():
    up = sorted(f"{m} -> {i}" for m, p in NAMES.items() for i in _imports(p) if _layer(i) > _layer(m))
    assert not up, up
    assert all(_layer(m) >= 0 for m in NAMES if m != "trainapp"), sorted(NAMES)


def test_no_import_cycle_even_through_function_level_imports():
    graph = {m: _imports(p) for m, p in NAMES.items()}
    done, stack, cycles = set(), [], []

    def visit(m: str) -> None:
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in done:
            return
        stack.append(m)
        for n in sorted(graph[m]):
            visit(n)
        stack.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert not cycles, cycles


def _module_state(path: Path) -> list[str]:
    """Module-level names bound to something mutable, or rebound later (`global`)."""
    found = []
    tree = _tree(path)
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        value = getattr(node, "value", None)
        for t in targets:
            names = [t.id] if isinstance(t, ast.Name) else []
            for name in names:
                constant = name.lstrip("_").isupper() or name in ("log", "__all__", "__version__")
                literal = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp,
                                             ast.SetComp))
                if not constant or (literal and name != "__all__"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    found += [f"{path.relative_to(REPO)}:{n.lineno} global {', '.join(n.names)}" for n in ast.walk(tree)
              if isinstance(n, ast.Global)]
    return found


def test_no_mutable_module_global_state():
    """State is owned by objects that are passed on (the rank's guard, the timeline, the snapshot
    manager), not kept in modules: constants only, and never a mutable container."""
    found = [f for p in MODULES for f in _module_state(p)]
    assert not found, found


def test_one_place_ends_the_process():
    calls = [f"{p.relative_to(REPO)}:{n.lineno}" for p in MODULES for n in ast.walk(_tree(p))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "_exit"]
    assert calls == ["trainapp/errors.py:" + calls[0].split(":")[1]] and len(calls) == 1, calls


def test_failure_metadata_is_typed_not_looked_up_with_getattr():
    looked_up = [f"{p.relative_to(REPO)}:{n.lineno}" for p in MODULES for n in ast.walk(_tree(p))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr"
                 and len(n.args) > 1 and isinstance(n.args[1], ast.Constant)
                 and n.args[1].value in ("exit_code", "cause", "failure_cause", "everywhere")]
    assert not looked_up, looked_up


def test_build_makes_the_parts_in_order_visiting_each_core_module_once():
    """`build` (trainapp/core/build.py) calls into the core modules in build order (the task: its
    datasets and model; the layout of the global batch, the data loaders, precision, optimizer, state),
    each in one stretch: no part goes back to a module it has left."""
    build = next(n for n in ast.walk(_tree(PACKAGE / "core" / "build.py"))
                 if isinstance(n, ast.FunctionDef) and n.name == "build")
    by_name = {"resolve": "task", "bind": "task", "task": "task", "data": "data", "Precision": "amp",
               "Layout": "layout", "optim": "optim", "TrainState": "state", "RngState": "state",
               "state": "state"}
    seen = []
    for n in sorted((n for n in ast.walk(build) if isinstance(n, ast.Call)),
                    key=lambda n: (n.lineno, n.col_offset)):
        f = n.func
        head = (f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                else getattr(f, "id", None))
        module = by_name.get(head)
        if module and (not seen or seen[-1] != module):
            seen.append(module)
    assert seen == ["task", "layout", "data", "amp", "optim", "state"], seen


def test_the_loop_reads_no_notice_signal_launcher_or_ray():
    """The boundary decides and the loop obeys (trainapp/faults/boundary.py's `Stop`): the loop's code
    names no notice, signal, Ray or launcher, and imports nothing of the launchers or the preemption
    machinery. A stop arrives as an object the loop executes."""
    path = PACKAGE / "core" / "loop.py"
    tree = _tree(path)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    banned = {"notice", "notices", "signal", "signals", "signum", "ray", "launcher", "launch", "publish",
              "preempted", "resized", "stopped", "stop_by", "stop_kind", "drain", "drains"}
    found = sorted(n for n in names if banned & set(n.lower().split("_")) or n.lower() in banned)
    assert not found, found
    assert not [m for m in _imports(path) if m.startswith(("trainapp.launch", "trainapp.faults.preempt"))]


def test_the_loop_and_build_ask_the_strategy_and_name_no_data_parallel_kind():
    """DDP and FSDP live in trainapp/core/parallel/: the loop and `build` neither branch on them nor name
    them, in code or comments, so a strategy (or compile, or checkpointing) changes nothing there."""
    import re

    found = []
    for path in (PACKAGE / "core" / "loop.py", PACKAGE / "core" / "build.py"):
        text = path.read_text()
        found += [f"{path.name}: {m}" for m in re.findall(
            r"(?i)\w*(?:ddp|fsdp|DistributedDataParallel|fully_shard)\w*", text)]
        found += [f"{path.name}:{n.lineno} .{n.attr}" for n in ast.walk(ast.parse(text))
                  if isinstance(n, ast.Attribute) and n.attr in ("sharded", "ddp")]
    assert not found, found


RUN_OUTPUT = re.compile(r"(^|/)(mlruns|mlartifacts|runs)/|(^|/)step_\d{9}/|\.(safetensors|pt|pth|distcp|db)$"
                        r"|(^|/)(metrics\.jsonl|memory-id|report\.(png|txt))$")
"""What a run leaves: MLflow stores and artifacts, run directories, snapshots, models, metrics, reports."""


def test_the_repository_tracks_no_run_output():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    found = [p for p in tracked.splitlines() if RUN_OUTPUT.search(p)]
    assert not found, f"run outputs are committed (add them to .gitignore, git rm them): {found}"


WHOLE_CONFIG = {"trainapp/launch/rank.py", "trainapp/launch/ray/driver.py", "trainapp/core/build.py",
                "trainapp/tasks/load.py", "trainapp/tasks/image.py", "trainapp/tools/doctor.py"}
"""Where the whole configuration is read: the rank's assembler and the parts' (`run_rank`, `build`), the Ray
driver's entry, the task factory (a task may take the whole config: trainapp/tasks/load.py) and the built-in
image task's, and `doctor`, which checks all of it. Every other part is given its own section or the few
values it uses."""


def test_the_whole_config_is_taken_in_at_most_six_files():
    def takes_config(a: ast.arg) -> bool:
        ann = a.annotation
        return (isinstance(ann, ast.Name) and ann.id == "Config") or (
            isinstance(ann, ast.Attribute) and ann.attr == "Config")

    found = {str(p.relative_to(REPO)) for p in MODULES for n in ast.walk(_tree(p))
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             for a in [*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs,
                       *([n.args.vararg] if n.args.vararg else [])] if takes_config(a)}
    found = {f for f in found if not f.startswith("trainapp/config/")}
    assert found <= WHOLE_CONFIG and len(WHOLE_CONFIG) <= 6, sorted(found - WHOLE_CONFIG)
