"""The test tree's own rules: every test module is in a package, and no module under tests/ imports a
test module (what tests share is a fixture in a conftest.py or code in tests/helpers/)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers.paths import TESTS

# Not agl's tests: a third-party package's (scripts/wheel_smoke.sh) and recorded inputs.
NOT_OURS = ("fixtures", "wheel_smoke")
# ``module:Name``, how a config names a class to load (``agentlightning.local.agent_class=...``).
DOTTED_CLASS = re.compile(r"\b(tests(?:\.\w+)+):\w+")


def our_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.relative_to(TESTS).parts[0] not in NOT_OURS)


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)


def imported_names(source: str, package: str) -> set[str]:
    """Every module ``source`` may import: ``from a import b`` counts as ``a`` and ``a.b``; relative
    imports are resolved against ``package``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def is_test_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "tests" and parts[-1].startswith("test_")


def test_every_test_module_is_in_a_package():
    """A folder without ``__init__.py`` would make pytest import its modules by their bare names."""
    missing = sorted(
        str(path.parent.relative_to(TESTS.parent))
        for path in our_modules()
        if not (path.parent / "__init__.py").exists()
    )
    assert missing == []


def test_no_module_under_tests_imports_a_test_module():
    offenders = []
    for path in our_modules():
        name = module_name(path)
        source = path.read_text()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        used = imported_names(source, package) | set(DOTTED_CLASS.findall(source))
        offenders += [f"{name} -> {other}" for other in sorted(used) if is_test_module(other) and other != name]
    assert offenders == []


def test_the_check_sees_each_way_of_reaching_a_test_module():
    source = (
        "from tests.stages.test_pipeline import batch\n"
        "from tests import test_docs\n"
        "import tests.verl.test_config\n"
        "from .test_aggregators import call\n"
        "from tests.helpers.rollouts import call\n"
    )
    found = {n for n in imported_names(source, "tests.builtins") if is_test_module(n)}
    assert found == {
        "tests.stages.test_pipeline",
        "tests.test_docs",
        "tests.verl.test_config",
        "tests.builtins.test_aggregators",
    }
    dotted = ":".join(
        ("agent_class=tests.rollouts.test_embedded", "EchoAgent")
    )  # joined: this file names no test module
    assert DOTTED_CLASS.findall(dotted) == ["tests.rollouts.test_embedded"]
