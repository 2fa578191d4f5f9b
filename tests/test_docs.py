"""The manual cites only files the sdist ships: every repository path a page names exists and is in
the packages or in MANIFEST.in."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from agl_core.scaffold import FILES as PLUGIN_TEMPLATE_FILES
from tests.helpers.paths import REPO_ROOT as REPO

PACKAGES = ("agl_core", "agl_hooks", "agl_backend_verl")
CITED = re.compile(r"`((?:\.ci|tests|scripts|examples|benchmarks|docs|agl_core|agl_hooks|agl_backend_verl)/[^`\s]*)`")


def shipped(manifest: str) -> tuple[set[str], set[str]]:
    """The folders MANIFEST.in grafts and the files it includes."""
    folders, files = set(), set()
    for line in manifest.splitlines():
        words = line.split()
        if words[:1] == ["graft"]:
            folders.update(words[1:])
        elif words[:1] == ["include"]:
            files.update(words[1:])
    return folders, files


def uncited_or_unshipped(root: Path) -> list[str]:
    folders, files = shipped((root / "MANIFEST.in").read_text())
    written_by_new_plugin = {path for path in PLUGIN_TEMPLATE_FILES if "{" not in path}
    problems = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for path in CITED.findall(page.read_text()):
            path = path.rstrip("/.,:;")
            if path in written_by_new_plugin:
                continue
            where = f"{page.relative_to(root)} cites {path}"
            if not (root / path).exists():
                problems.append(f"{where}, which does not exist")
            elif path.split("/")[0] not in PACKAGES and path.split("/")[0] not in folders and path not in files:
                problems.append(f"{where}, which the sdist does not ship (MANIFEST.in)")
    return problems


def test_every_path_the_manual_cites_exists_and_ships_in_the_sdist():
    assert uncited_or_unshipped(REPO) == []


def test_an_unshipped_or_missing_citation_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "x.py").write_text("")
    (tmp_path / "MANIFEST.in").write_text("graft docs\n")
    (tmp_path / "README.md").write_text("see `scripts/gone.sh`\n")
    (tmp_path / "docs" / "a.md").write_text("see `docs/a.md`, `tests/test_training.py` and `benchmarks/x.py`\n")
    assert uncited_or_unshipped(tmp_path) == [
        "README.md cites scripts/gone.sh, which does not exist",
        "docs/a.md cites benchmarks/x.py, which the sdist does not ship (MANIFEST.in)",
    ]


def test_the_python_floor_is_the_oldest_python_tested():
    """requires-python, ruff's target, the classifiers, the plugin template and the README all name
    the oldest Python CI tests on (3.11, constraints/cpu.txt's lane; the others are 3.12 and 3.13)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    tested = sorted(c.rsplit(" ", 1)[1] for c in project["project"]["classifiers"] if re.fullmatch(r".*:: 3\.\d+", c))
    assert tested == ["3.11", "3.12", "3.13"]
    assert project["project"]["requires-python"] == f">={tested[0]}"
    assert project["tool"]["ruff"]["target-version"] == "py" + tested[0].replace(".", "")
    assert (
        f'requires-python = ">={tested[0]}"'
        in (REPO / "agl_core" / "plugin_template" / "pyproject.toml.tmpl").read_text()
    )
    assert f"tested on Python {', '.join(tested[:-1])} and {tested[-1]}" in (REPO / "README.md").read_text()


MAP_PACKAGES = ("agl_core", "agl_hooks", "agl_backend_verl", "agl_backend_trl")
MAP_COLUMN = 39  # where the package map's descriptions start; module names are left of it


def package_map() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    return text.split("## The package map and its import rules", 1)[1].split("```")[1]


def listed_modules(block: str) -> dict[str, set[str]]:
    """Package folder (``agl_core/backends/torch``) -> the names the package map lists under it: a
    line whose names start with ``folder/`` opens that package, nested by indentation; a line less
    indented than the names of the package open above it lists names of its parent."""
    listed: dict[str, set[str]] = {}
    open_packages: list[tuple[int, str]] = []  # (indent of the folder's line, its path)
    for line in block.splitlines():
        names = line[:MAP_COLUMN]
        if not names.strip():
            continue
        indent = len(names) - len(names.lstrip())
        tokens = re.findall(r"[A-Za-z_][A-Za-z0-9_]*/?", names)
        while open_packages and open_packages[-1][0] >= indent:
            open_packages.pop()
        if tokens[0].endswith("/"):
            parent = open_packages[-1][1] + "/" if open_packages else ""
            open_packages.append((indent, parent + tokens[0][:-1]))
            tokens = tokens[1:]
        listed.setdefault(open_packages[-1][1], set()).update(tokens)
    return listed


def unlisted_modules(modules: list[str], block: str) -> list[str]:
    """Of ``modules`` (paths such as ``agl_core/stages/tensorize.py``), those the package map does not
    name under their own package."""
    listed = listed_modules(block)
    missing = []
    for module in modules:
        package, _, name = module.removesuffix(".py").rpartition("/")
        if name != "__init__" and name.replace("pytest_plugin", "pytest") not in listed.get(package, set()):
            missing.append(module)
    return missing


def test_the_package_map_names_every_module_under_its_package():
    """docs/architecture.md's package map names each module of every package under its own package
    (a module added without its place in the map fails here)."""
    modules = [str(p.relative_to(REPO)) for package in MAP_PACKAGES for p in sorted((REPO / package).rglob("*.py"))]
    assert unlisted_modules(modules, package_map()) == []


@pytest.mark.parametrize(
    "planted",
    # named in the map, but under another package (backends/loop, serving/weights), or not at all
    ["agl_core/plugins/loop.py", "agl_core/stages/weights.py", "agl_backend_trl/extra.py"],
)
def test_a_module_named_only_under_another_package_is_unlisted(planted):
    assert unlisted_modules([planted], package_map()) == [planted]
