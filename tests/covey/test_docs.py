"""The docs hold: every repository path that README.md, docs/ and the code's docstrings and
comments name exists, every link between the docs resolves, every setting the code reads is in
docs/configuration.md, and nothing sends a reader outside the repository.

What counts as a repository path (docs/development.md, "What the docs test checks"): a word that
begins with the name of one of the repository's top-level directories and a slash
(``runners/host/homes.py``, ``docs/isolation.md``, ``scripts/run``, ``deploy/systemd/``), where
a word is a run of letters, digits and ``_ . - * /`` not preceded by one of those, ``$`` or
``=`` (so the ``runs/`` of ``/api/v1/runs/``, ``$URL/runs/`` or ``?path=runs/x`` is no path).
It is named from the repository's root, may end in ``/`` (a directory) or hold ``*`` (a glob
that must match), and loses a full stop or comma that ends a sentence. In Markdown every word
counts; in Python, the words of comments and docstrings. A Markdown link's target is relative
to its own page, and an ``#anchor`` must be a heading of the page it points at.
"""

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from tests.processes import ROOT

# Built from pieces, so that this file does not name them itself.
OUTSIDE = ("DESIGN" + ".md", ".." + "/shared")

# Names the code reads from its environment that are not settings, each with why.
NOT_SETTINGS = {
    "COVEY_PROBE": "the plan a runner host gives its probe container (runners/probe/program.py)",
}


@cache
def tracked() -> tuple[str, ...]:
    """The repository's files: tracked, and new ones git does not ignore."""
    listing = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return tuple(name for name in listing.stdout.split("\0") if name and (ROOT / name).exists())


@cache
def path_pattern() -> re.Pattern[str]:
    """A path-looking word: a top-level directory of the repository, a slash, the rest."""
    tops = sorted({name.split("/")[0] for name in tracked() if "/" in name}, key=len, reverse=True)
    alternatives = "|".join(re.escape(top) for top in tops)
    return re.compile(rf"(?<![\w.*/$=-])(?:{alternatives})/[\w.*/-]*")


def paths_named(text: str) -> Iterator[str]:
    """The repository paths ``text`` names, as written (a sentence's full stop taken off)."""
    for match in path_pattern().finditer(text):
        yield match.group(0).rstrip(".,")


def missing(path: str, root: Path = ROOT) -> bool:
    """Whether ``path`` (from the repository's root) names nothing there."""
    if "*" in path:
        return not any(root.glob(path.rstrip("/")))
    return not (root / path).exists()


def markdown_files() -> list[str]:
    return sorted(name for name in tracked() if name == "README.md" or
                  (name.startswith("docs/") and name.endswith(".md")))  # fmt: skip


def python_files() -> list[str]:
    return sorted(name for name in tracked() if name.endswith(".py"))


DOCUMENTED = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def comments_and_docstrings(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python module."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, DOCUMENTED) and (docstring := ast.get_docstring(node, clean=False)):
            yield node.body[0].lineno, docstring


def named_in(name: str) -> Iterator[tuple[int, str]]:
    """(line, text) of a file that may name paths: Markdown whole, Python's comments and
    docstrings."""
    text = (ROOT / name).read_text()
    if name.endswith(".md"):
        yield from enumerate(text.splitlines(), start=1)
    else:
        yield from comments_and_docstrings(text)


def wrong_paths(names: list[str]) -> list[str]:
    return [
        f"{name}:{line}: {path}"
        for name in names
        for line, text in named_in(name)
        for path in paths_named(text)
        if missing(path)
    ]


def test_every_path_the_readme_and_docs_name_exists():
    assert wrong_paths(markdown_files()) == []


def test_every_path_a_docstring_or_comment_names_exists():
    assert wrong_paths(python_files()) == []


def test_a_wrong_path_is_found_and_urls_and_prose_are_not_paths(tmp_path):
    text = (
        "See `runners/engine.py` and docs/nowhere.md. Then `runners/host/homes.py`, "
        "deploy/systemd/*.service, docs/. Not /api/v1/runs/, $URL/runs/1, ?path=docs/x, "
        "~/.cache/covey/."
    )
    assert [path for path in paths_named(text) if missing(path)] == [
        "runners/engine.py",
        "docs/nowhere.md",
    ]
    assert [path for path in paths_named(text) if not missing(path)] == [
        "runners/host/homes.py",
        "deploy/systemd/*.service",
        "docs/",
    ]
    module = '"""Moved: egress/feed.py."""\n\nX = "runners/engine.py"  # see runners/firewall.py\n'
    assert [path for _, text in comments_and_docstrings(module) for path in paths_named(text)] == [
        "runners/firewall.py",
        "egress/feed.py",
    ]


def slug(heading: str) -> str:
    """The anchor a heading gets, as GitHub makes it."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in page.read_text().splitlines()
            if re.match(r"#{1,6} ", line)}  # fmt: skip


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def broken_links(name: str) -> Iterator[str]:
    page = ROOT / name
    for line, text in enumerate(page.read_text().splitlines(), start=1):
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("/"):
                continue  # a URL, or a path of the running control plane
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if not linked.exists():
                yield f"{name}:{line}: {target} (no such file)"
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                yield f"{name}:{line}: {target} (no such heading)"


def test_every_link_between_the_docs_resolves_to_a_file_and_heading():
    assert [problem for name in markdown_files() for problem in broken_links(name)] == []


def test_a_heading_gets_the_anchor_github_gives_it():
    assert slug("Cooperative level: bypassable") == "cooperative-level-bypassable"
    assert slug("The `egress_probe`, and why") == "the-egress_probe-and-why"


def test_nothing_sends_a_reader_outside_the_repository():
    found = []
    for name in tracked():
        try:
            text = (ROOT / name).read_text()
        except (UnicodeDecodeError, IsADirectoryError):
            continue  # binary
        found += [f"{name}: {needle}" for needle in OUTSIDE if needle in text]
    assert found == []


READ = re.compile(
    r"""\benv\.\w+\(\s*["']([A-Z][A-Z0-9_]+)["']"""
    r"""|(?:environ\.get|getenv)\(\s*["']((?:COVEY|DJANGO)_[A-Z0-9_]+)["']"""
    r"""|environ\[\s*["']((?:COVEY|DJANGO)_[A-Z0-9_]+)["']\](?!\s*=[^=])"""
)


def settings_read() -> set[str]:
    """Every environment variable covey's own code (not its tests or benches) reads."""
    names = set()
    for name in python_files():
        if name.startswith(("tests/", "bench/")):
            continue
        for match in READ.finditer((ROOT / name).read_text()):
            names.add(next(group for group in match.groups() if group))
    return names - set(NOT_SETTINGS)


def test_every_setting_the_code_reads_is_in_the_configuration_page():
    page = (ROOT / "docs" / "configuration.md").read_text()
    listed = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", page))
    assert settings_read(), "the pattern finds the settings"
    assert sorted(settings_read() - listed) == []


@pytest.mark.parametrize("name", ["README.md", "docs/configuration.md"])
def test_every_covey_variable_the_docs_name_is_named_in_the_code(name):
    """A variable the docs name still means something: some file outside the docs names it."""
    elsewhere = "\n".join(
        (ROOT / other).read_text(errors="replace")
        for other in tracked()
        if not other.endswith(".md") and not other.startswith("tests/")
    )
    named = set(re.findall(r"\b((?:COVEY|DJANGO)_[A-Z0-9_]*[A-Z0-9])\b", (ROOT / name).read_text()))
    assert sorted(variable for variable in named if variable not in elsewhere) == []
