"""Installing agl never breaks another project's pytest: in a real venv that has agl's code but not
hypothesis (the ``test`` extra), agl's pytest plugin loads and an unrelated test passes, and the
hypothesis-based helpers fail their import with the command that installs hypothesis."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from agl_core.testing import TEST_EXTRA_INSTALL
from tests.helpers.paths import REPO_ROOT

# pytest and what it needs, plus numpy (a dependency of agl that contracts.py imports before hypothesis).
LINKED_DISTRIBUTIONS = ("pytest", "numpy")
UNRELATED_TEST = """\
import importlib.util

def test_unrelated():
    assert importlib.util.find_spec("hypothesis") is None
"""


def _link_distribution(name: str, into: Path, done: set[str]) -> None:
    """Symlink ``name``'s installed top-level files, and those of what it requires, into ``into``."""
    dist = importlib.metadata.distribution(name)
    key = dist.metadata["Name"].lower()
    if key in done:
        return
    done.add(key)
    roots = {Path(str(file)).parts[0] for file in dist.files or [] if not str(file).startswith("..")}
    for root in roots:
        if not (into / root).exists():
            (into / root).symlink_to(Path(dist.locate_file(root)))
    for spec in dist.requires or []:
        requirement = Requirement(spec)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            _link_distribution(requirement.name, into, done)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (no pip) that sees the repository, pytest and numpy, and no hypothesis."""
    root = tmp_path_factory.mktemp("no-hypothesis")
    venv.create(root / "venv", with_pip=False)
    python = root / "venv" / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    links = root / "links"
    links.mkdir()
    done: set[str] = set()
    for name in LINKED_DISTRIBUTIONS:
        _link_distribution(name, links, done)
    assert "hypothesis" not in done
    (Path(site) / "agl-and-pytest.pth").write_text(f"{REPO_ROOT}\n{links}\n")
    return python


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    # Only the ``-p`` plugin: where the venv can see agl's installed metadata, its pytest11 entry
    # point would load the same module a second time.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_agl_pytest_plugin_loads_without_hypothesis(bare_python: Path, tmp_path: Path):
    (tmp_path / "test_unrelated.py").write_text(UNRELATED_TEST)
    run = _run(
        bare_python, "-m", "pytest", "-p", "agl_core.testing.pytest_plugin", "-q", "test_unrelated.py", cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
    fixtures = _run(bare_python, "-m", "pytest", "-p", "agl_core.testing.pytest_plugin", "--fixtures", cwd=tmp_path)
    assert fixtures.returncode == 0, fixtures.stdout + fixtures.stderr
    assert "agl_plugin_manager_factory" in fixtures.stdout


@pytest.mark.parametrize("module", ["agl_core.testing.strategies", "agl_core.testing.contracts"])
def test_the_hypothesis_helpers_name_the_extra_to_install(bare_python: Path, tmp_path: Path, module: str):
    run = _run(bare_python, "-c", f"import {module}", cwd=tmp_path)
    assert run.returncode != 0
    assert f"ImportError: {module} needs hypothesis" in run.stderr
    assert TEST_EXTRA_INSTALL in run.stderr
