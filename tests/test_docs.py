"""README.md is a front page and the docs hang together: every relative markdown link in README.md and
docs/*.md points at a file (and, for a markdown file, a heading) that exists."""

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
