"""README.md is a front page and the docs hang together: every relative markdown link in README.md and
docs/*.md points at a file (and, for a markdown file, a heading) that exists, and every test
docs/testing.md's failure-mode table names exists and runs in the tier its row gives."""

import ast
import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, CODE_SPAN.sub("", line)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (lower case, punctuation dropped, spaces to dashes), and
    its explicit ones (`<a id="name"></a>`)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        out |= set() if fenced else set(re.findall(r'<a id="([^"]+)"></a>', line))
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def relative_links(page: Path):
    for n, line in prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
                continue
            yield n, target


def test_there_are_docs_pages_to_check():
    assert (REPO / "docs").is_dir() and len(PAGES) > 1


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for n, target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(REPO)}:{n}: {target}"
        if not dest.exists():
            broken.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, \
        f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"


def test_every_docs_page_links_back_to_the_readme():
    pages = [p for p in PAGES if p.parent.name == "docs"]
    missing = [p.name for p in pages if "(../README.md" not in p.read_text()]
    assert not missing, missing


CONFIG_PATH = re.compile(r"\bconfigs/[\w.-]+\.ya?ml\b")


def test_every_config_file_the_docs_and_docstrings_name_exists():
    texts = [*PAGES, *sorted((REPO / "trainapp").glob("*.py")), *sorted((REPO / "k8s").rglob("*.md")),
             REPO / "ray_cluster" / "README.md", REPO / "docker" / "README.md"]
    named = {(p.relative_to(REPO), m) for p in texts for m in CONFIG_PATH.findall(p.read_text())}
    assert named, "no configs/*.yaml named anywhere: the pattern is wrong"
    missing = sorted(f"{where}: {path}" for where, path in named if not (REPO / path).is_file())
    assert not missing, missing


# ----------------------------------------------------------------------------------------------
# docs/testing.md's failure-mode table names tests: each must exist and run in the tier its row gives, or
# the table stops being true the day a test is renamed or moved to another tier.

FAILURE_MODES = "## Failure modes and the tests that cover them"
COLUMNS = ["failure mode", "the real fault", "launcher", "test", "tier"]
LAUNCHERS = {"alone", "torchrun", "Ray", "Slurm", "—"}
TIERS = {"fast", "test", "long", "e2e", "slurm"}
NAMED_TEST = re.compile(r"\b(test_\w+\.py)::(\w+)")
TESTS = REPO / "tests"


def _conftest_value(name: str):
    """A literal of tests/conftest.py, read without importing it (it starts nothing, but imports much)."""
    for node in ast.parse((TESTS / "conftest.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return node.value
    raise AssertionError(f"tests/conftest.py has no {name}")


LONG = set(ast.literal_eval(_conftest_value("LONG")))
SEPARATE = [ast.literal_eval(key) for key in _conftest_value("SEPARATE").keys]  # e2e, slurm, bench


def _marks(expr: ast.expr | None, aliases: dict[str, set[str]]) -> set[str]:
    """The marker names an expression applies: `pytest.mark.x`, `pytest.mark.x(...)`, a list of them, or
    a module-level name bound to one (`slow = pytest.mark.slow`)."""
    if isinstance(expr, ast.Call):
        return _marks(expr.func, aliases)
    if isinstance(expr, (ast.List, ast.Tuple)):
        return set().union(*(_marks(e, aliases) for e in expr.elts))
    if isinstance(expr, ast.Name):
        return aliases.get(expr.id, set())
    if isinstance(expr, ast.Attribute) and ast.unparse(expr.value) == "pytest.mark":
        return {expr.attr}
    return set()


def _param_marks(decorator: ast.expr, aliases: dict[str, set[str]]) -> list[set[str]]:
    """The marks of each case of `@pytest.mark.parametrize(names, [..., pytest.param(..., marks=...)])`;
    one case without marks for any other decorator, or values that are not a literal list."""
    if not (isinstance(decorator, ast.Call) and "parametrize" in _marks(decorator, aliases)
            and len(decorator.args) > 1 and isinstance(decorator.args[1], (ast.List, ast.Tuple))):
        return [set()]
    return [set().union(*(_marks(k.value, aliases) for k in v.keywords if k.arg == "marks"))
            if isinstance(v, ast.Call) and ast.unparse(v.func) == "pytest.param" else set()
            for v in decorator.args[1].elts]


def _tier(marks: set[str], file: str) -> str:
    """Which target runs a test with these markers (conftest.py: SEPARATE's markers are skipped elsewhere,
    LONG's files are marked `long`, `make test-fast` takes what is not `slow`)."""
    separate = [m for m in SEPARATE if m in marks]
    if separate:
        return separate[0]
    if "slow" not in marks:
        return "fast"
    return "long" if "long" in marks or file in LONG else "test"


@functools.cache
def tiers_in(file: str) -> dict[str, set[str]]:
    """{test function: the tiers its cases run in} of tests/FILE: top-level `test_*` functions and the
    `test_*` methods of `Test*` classes, marked by the module's `pytestmark`, their class and their own
    decorators (each parametrized case with its `pytest.param` marks)."""
    tree = ast.parse((TESTS / file).read_text())
    aliases: dict[str, set[str]] = {}
    module: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "pytestmark":
                module = _marks(node.value, aliases)
            elif _marks(node.value, aliases):
                aliases[node.targets[0].id] = _marks(node.value, aliases)
    found: dict[str, set[str]] = {}

    def add(fn: ast.FunctionDef | ast.AsyncFunctionDef, inherited: set[str]) -> None:
        base = module | inherited | set().union(*(_marks(d, aliases) for d in fn.decorator_list))
        cases = [set()]
        for decorator in fn.decorator_list:
            cases = [c | p for c in cases for p in _param_marks(decorator, aliases)]
        found[fn.name] = {_tier(base | case, file) for case in cases}

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            add(node, set())
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            inherited = set().union(*(_marks(d, aliases) for d in node.decorator_list))
            for fn in node.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name.startswith("test"):
                    add(fn, inherited)
    return found


def failure_mode_rows() -> list[list[str]]:
    """The cells of each row of docs/testing.md's failure-mode table, its header checked."""
    lines = (REPO / "docs" / "testing.md").read_text().splitlines()
    assert FAILURE_MODES in lines, f"docs/testing.md has no section {FAILURE_MODES!r}"
    table = []
    for line in lines[lines.index(FAILURE_MODES) + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif table:
            break
    assert table and table[0] == COLUMNS, f"docs/testing.md failure modes: the header is not {COLUMNS}"
    return table[2:]


def row_problems(row: list[str], tiers_of) -> list[str]:
    """What is wrong with one row; `tiers_of(file)` gives {test: tiers} of a test file."""
    where = f"docs/testing.md failure modes, row {row[0]!r}"
    if len(row) != len(COLUMNS):
        return [f"{where}: {len(row)} cells, not {len(COLUMNS)}"]
    launchers = {word.strip() for word in row[2].split(",")}
    named = NAMED_TEST.findall(row[3])
    tiers = [{t.strip() for t in entry.split(",")} for entry in row[4].split("<br>")]
    problems = [f"{where}: launcher {sorted(launchers - LAUNCHERS)} is none of {sorted(LAUNCHERS)}"
                ] if launchers - LAUNCHERS else []
    problems += [f"{where}: tier {sorted(t - TIERS)} is none of {sorted(TIERS)}" for t in tiers if t - TIERS]
    if not named:
        return [*problems, f"{where}: names no test as file.py::test_name"]
    if len(tiers) not in (1, len(named)):
        return [*problems, f"{where}: {len(tiers)} tiers for {len(named)} tests: one for all, or one each"]
    for (file, name), want in zip(named, tiers * len(named) if len(tiers) == 1 else tiers):
        if not (TESTS / file).is_file():
            problems.append(f"{where}: {file}::{name}: no tests/{file}")
        elif name not in tiers_of(file):
            problems.append(f"{where}: {file}::{name} not found in tests/{file}")
        elif tiers_of(file)[name] != want:
            problems.append(f"{where}: {file}::{name} runs in {', '.join(sorted(tiers_of(file)[name]))} "
                            f"(its markers), the row says {', '.join(sorted(want))}")
    return problems


def test_every_test_the_failure_mode_table_names_exists_in_the_tier_its_row_gives():
    rows = failure_mode_rows()
    assert len(rows) >= 30, f"docs/testing.md failure modes: only {len(rows)} rows: the table was cut?"
    problems = [p for row in rows for p in row_problems(row, tiers_in)]
    assert not problems, "\n".join(problems)


def test_the_table_check_finds_a_renamed_test_and_a_wrong_tier():
    """The check itself, on rows made here: a name no file has, and a tier its markers do not give."""
    renamed = ["a lost node", "raylet SIGKILLed", "Ray", "`test_ray.py::test_lost_node`", "e2e"]
    assert row_problems(renamed, tiers_in) == [
        "docs/testing.md failure modes, row 'a lost node': test_ray.py::test_lost_node not found in "
        "tests/test_ray.py"]
    # test_elastic.py: the module is slow, one case e2e and the other long (pytest.param marks)
    elastic = ("test_elastic.py::test_torchrun_agents_leaving_and_returning_resize_2_1_2_and_train_every_"
               "sample_once")
    # in a file of LONG, but not slow: make test-fast runs it
    fast = "test_preempt.py::test_drain_and_node_do_not_import_torch"
    wrong = ["agents", "SIGTERM", "torchrun", f"`{elastic}`<br>`{fast}`", "long<br>long"]
    row = "docs/testing.md failure modes, row 'agents'"
    assert row_problems(wrong, tiers_in) == [
        f"{row}: {elastic} runs in e2e, long (its markers), the row says long",
        f"{row}: {fast} runs in fast (its markers), the row says long"]
