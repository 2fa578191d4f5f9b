"""The manual cites only files the sdist ships: every repository path a page names exists and is in
the packages or in MANIFEST.in."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

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


def test_the_package_map_names_every_module():
    """docs/architecture.md's package map names each module of agl_core under its package (a module
    added without a place in the map fails here)."""
    import re

    from tests.helpers.paths import REPO_ROOT

    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## The package map and its import rules", 1)[1].split("```")[1]
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", block))
    package = REPO_ROOT / "agl_core"
    missing = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if path.stem != "__init__" and path.stem.replace("pytest_plugin", "pytest") not in words
    ]
    assert missing == [], f"modules the package map of docs/architecture.md does not name: {missing}"
