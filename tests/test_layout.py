"""The package stays easy to change: small modules with one job each, and no function so long that a
reader has to scroll to follow it (the house style: nanoGPT's train.py, pytorch/examples' multinode.py)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted((REPO / "trainapp").rglob("*.py"))
MAX_FUNCTION_LINES = 50
MAX_MODULE_LINES = 500


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_function_in_trainapp_is_longer_than_50_lines():
    long = [f"{p.name}:{line} {name} ({n} lines)" for p in MODULES for name, line, n in _functions(p)
            if n > MAX_FUNCTION_LINES]
    assert not long, long


def test_no_module_in_trainapp_is_longer_than_500_lines():
    long = [f"{p.name} ({n} lines)" for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, long


def test_every_module_says_what_it_is_for():
    missing = [p.name for p in MODULES if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, missing
