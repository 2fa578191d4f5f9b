"""The package map's import rules (docs/architecture.md), checked by parsing every import.

Each module belongs to one part; a part may import only the parts listed for it. Imports under
``if TYPE_CHECKING:`` are annotations only and are not counted. A rollout source family (the
gateway sources, the embedded source) may import the shared rollout modules and itself, never
another family.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.imports import BACKEND_TOOLKIT
from tests.helpers.paths import REPO_ROOT

PACKAGES = ("agl_core", "agl_hooks", "agl_backend_verl", "agl_backend_trl")
BACKEND_PACKAGES = ("agl_backend_verl", "agl_backend_trl")

# Top-level agl_core modules everything may use: the data model, the config, the hookspecs, helpers.
# The package root (the public API) is its own part; a name imported from it counts as an import of
# the module that defines the name.
API = "agl_core"
BASE = {
    "agl_core.data",
    "agl_core.errors",
    "agl_core.fields",
    "agl_core.config",
    "agl_core.hookspecs",
    "agl_core.suggestions",
    "agl_core.local_http",
}
BASE_PACKAGES = ("agl_core.config", "agl_core.files")  # the config, the files agl reads and writes
# The commands and the run driver: the top of the package map.
ENTRY = {"agl_core.cli", "agl_core.scaffold"}
ENTRY_PACKAGES = ("agl_core.runs",)
# The rollout source families, and the rollout modules every source shares.
SOURCE_FAMILIES = {
    "gateway": (
        "agl_core.rollouts.gateway",
        "agl_core.rollouts.gateway_sync",
        "agl_core.rollouts.gateway_async",
        "agl_core.rollouts.gateway_client",
        "agl_core.rollouts.gateway_error",
        "agl_core.rollouts.gateway_check",
        "agl_core.rollouts.retry",
    ),
    "embedded": ("agl_core.rollouts.embedded", "agl_core.rollouts.recorder", "agl_core.rollouts.agents"),
    "replay": ("agl_core.rollouts.replay",),
}
SHARED_ROLLOUT_MODULES = (
    "agl_core.rollouts",
    "agl_core.rollouts.source",
    "agl_core.rollouts.events",
    "agl_core.rollouts.finish",
    "agl_core.rollouts.streaming",
)

# part -> the parts it may import (its own part always included)
ALLOWED = {
    "api": {"base", "plugins", "stages", "rollouts", "backends", "tracking"},
    "base": {"base"},
    "plugins": {"base"},
    "stages": {"base", "plugins"},
    "rollouts": {"base", "plugins"},
    "serving": {"base"},
    "backends": {"base", "plugins", "stages", "rollouts", "serving"},
    "backend:torch": {"base", "plugins", "stages", "rollouts", "serving", "backends"},
    "tracking": {"base"},
    "builtins": {"base", "plugins", "stages", "tracking", "backends", "backend:torch"},
    "testing": {"base", "plugins", "stages", "rollouts", "serving", "backends", "backend:torch", "tracking", "entry"},
    "entry": {"base", "plugins", "rollouts", "backends", "tracking", "entry"},
    "agl_hooks": {"base", "plugins", "stages", "rollouts"},
    "backend:verl": {"base", "plugins", "stages", "rollouts", "serving", "backends", "entry"},
    "backend:trl": {"base", "plugins", "stages", "rollouts", "serving", "backends", "entry"},
}


def part_of(module: str) -> str:
    """Which part of the package map ``module`` belongs to."""
    for package in BACKEND_PACKAGES:
        if module.startswith(package):
            return f"backend:{package.removeprefix('agl_backend_')}"
    if module.startswith("agl_hooks"):
        return "agl_hooks"
    if module == API:
        return "api"
    if module in BASE or module.startswith(BASE_PACKAGES):
        return "base"
    if module in ENTRY or module.startswith(ENTRY_PACKAGES):
        return "entry"
    parts = module.split(".")
    if parts[1] == "backends" and len(parts) > 2 and parts[2] in {"torch"}:
        return "backend:torch"
    if parts[1] in {"plugins", "stages", "rollouts", "serving", "backends", "tracking", "testing", "builtins"}:
        return parts[1]
    raise AssertionError(
        f"{module} is in no part of the package map: add it to tests/test_import_rules.py and docs/architecture.md"
    )


def source_family(module: str) -> str | None:
    for family, modules in SOURCE_FAMILIES.items():
        if module in modules:
            return family
    return None


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every runtime import of an agl package (relative ones resolved)."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                found.append((child.lineno, module))
                # "from agl_core import stages" imports the submodule agl_core.stages
                found.extend((child.lineno, f"{module}.{alias.name}") for alias in child.names)
            visit(child)

    visit(tree)
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def _api_literal(root: Path, name: str) -> Any:
    """The literal a module-level assignment in ``agl_core/__init__.py`` gives ``name`` (empty if none)."""
    for node in ast.parse((root / "agl_core" / "__init__.py").read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [None])[0]
        if isinstance(target, ast.Name) and target.id == name:
            return ast.literal_eval(node.value)
    return {}


def _public_names(root: Path) -> dict[str, str]:
    """``agl_core.<name>`` -> the module it is imported from, for every name of the public API's
    name -> module table (``_MODULES``)."""
    return {f"{API}.{name}": module for name, module in _api_literal(root, "_MODULES").items()}


def _known_modules(root: Path) -> set[str]:
    return {_module_name(root, p) for package in PACKAGES for p in (root / package).rglob("*.py")}


def forbidden_imports(root: Path) -> list[str]:
    """Every import under ``root`` that breaks the package map's rules, as readable lines."""
    known = _known_modules(root)
    public = _public_names(root)
    problems = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            importer = _module_name(root, path)
            own_package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
            source = part_of(importer)
            for line, imported in _imports(ast.parse(path.read_text(), str(path)), own_package):
                imported = public.get(imported, imported)
                if imported == API:
                    continue  # the names it imports from the API are counted as their modules
                if imported not in known:
                    continue  # a name imported from a module, already counted as its module
                target = part_of(imported)
                where = f"{path.relative_to(root)}:{line} imports {imported}"
                if target != source and target not in ALLOWED[source]:
                    problems.append(f"{where}: {source} may not import {target}")
                elif source == target == "rollouts":
                    mine, theirs = source_family(importer), source_family(imported)
                    if theirs is not None and mine != theirs:
                        problems.append(
                            f"{where}: the {mine or 'shared rollout'} code may not import the {theirs} source"
                        )
    return problems


def test_every_import_follows_the_package_map():
    assert forbidden_imports(REPO_ROOT) == []


def private_core_imports(root: Path, package: str) -> list[str]:
    """Every import in ``package`` of ``agl_core`` other than ``from agl_core import <public name>`` or
    of the toolkit declared for backends (:data:`BACKEND_TOOLKIT`), imports under ``TYPE_CHECKING``
    included: a backend outside the core uses its public names only."""
    public = set(_api_literal(root, "__all__"))
    problems = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                problems += [
                    f"{where} imports {a.name}"
                    for a in node.names
                    if a.name.startswith(f"{API}.") and a.name not in BACKEND_TOOLKIT
                ]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == API:
                if node.module in BACKEND_TOOLKIT:
                    continue
                if node.module != API:
                    problems.append(f"{where} imports {node.module}")
                else:
                    problems += [
                        f"{where} imports {API}.{a.name}, which is not public"
                        for a in node.names
                        if a.name not in public
                    ]
    return problems


@pytest.mark.parametrize("package", BACKEND_PACKAGES)
def test_a_backend_package_imports_only_public_names_of_agl_core(package):
    assert private_core_imports(REPO_ROOT, package) == []


def test_a_private_import_of_the_core_is_reported(tmp_path):
    (tmp_path / "agl_core").mkdir()
    (tmp_path / "agl_core" / "__init__.py").write_text(
        "__all__ = ['Triplet']\n_MODULES = {'Triplet': 'agl_core.data'}\n"
    )
    (tmp_path / "agl_backend_verl").mkdir()
    (tmp_path / "agl_backend_verl" / "x.py").write_text(
        "from agl_core import Triplet\nfrom agl_core import _MODULES\nfrom agl_core.stages.tensorize import tensorize\n"
        "from agl_core.backends.ppo import ppo_loss\n"
    )
    assert private_core_imports(tmp_path, "agl_backend_verl") == [
        "agl_backend_verl/x.py:2 imports agl_core._MODULES, which is not public",
        "agl_backend_verl/x.py:3 imports agl_core.stages.tensorize",
    ]


def import_cycles(root: Path) -> list[list[str]]:
    """The cycles of the module import graph under ``root``, imports under ``TYPE_CHECKING``
    included (an annotation that names a module's type still ties the two modules together); an
    import of a module's own package does not count."""
    known = _known_modules(root)
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            importer = _module_name(root, path)
            targets = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    targets.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    targets.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
            graph[importer] = {t for t in targets & known if t != importer and not importer.startswith(f"{t}.")}
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in done:
                visit(target, [*path, target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    return cycles


def test_the_import_graph_has_no_cycle():
    assert import_cycles(REPO_ROOT) == []


def test_a_planted_type_only_import_cycle_is_found(tmp_path):
    (tmp_path / "agl_core").mkdir()
    (tmp_path / "agl_core" / "__init__.py").write_text("")
    (tmp_path / "agl_core" / "a.py").write_text("from agl_core.b import B\n")
    (tmp_path / "agl_core" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agl_core.a import A\n"
    )
    assert import_cycles(tmp_path) == [["agl_core.a", "agl_core.b", "agl_core.a"]]


def test_every_rollout_module_is_shared_or_in_one_source_family():
    named = [m for modules in SOURCE_FAMILIES.values() for m in modules] + list(SHARED_ROLLOUT_MODULES)
    actual = {m for m in _known_modules(REPO_ROOT) if m.startswith("agl_core.rollouts")}
    assert sorted(named) == sorted(actual), "classify new rollout modules in tests/test_import_rules.py"


@pytest.mark.parametrize(
    ("module", "planted", "message"),
    [
        (
            "agl_backend_verl/planted.py",
            "from agl_core.backends.torch.backend import TorchBackend\n",
            "backend:verl may not import backend:torch",
        ),
        (
            "agl_backend_trl/planted.py",
            "from agl_core.backends.torch.update import ActorUpdate\n",
            "backend:trl may not import backend:torch",
        ),
        ("agl_core/stages/planted.py", "import agl_core.rollouts.events\n", "stages may not import rollouts"),
        ("agl_core/plugins/planted.py", "from agl_hooks import loader\n", "plugins may not import agl_hooks"),
        (
            "agl_core/rollouts/embedded.py",
            "from agl_core.rollouts.gateway_client import GatewayClient\n",
            "may not import the gateway source",
        ),
        (
            "agl_core/serving/planted.py",
            "if True:\n    from agl_core.stages import tensorize\n",
            "serving may not import stages",
        ),
        ("agl_core/plugins/planted.py", "from agl_core import Aggregation\n", "plugins may not import stages"),
        ("agl_core/serving/planted.py", "from agl_core import LossSettings\n", "serving may not import stages"),
        (
            "agl_core/tracking/planted.py",
            "from agl_core.plugins import PluginManager\n",
            "tracking may not import plugins",
        ),
    ],
)
def test_a_planted_forbidden_import_is_reported(tmp_path, module, planted, message):
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            copy = tmp_path / path.relative_to(REPO_ROOT)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(path.read_text())
    target = tmp_path / module
    target.write_text(target.read_text() + "\n" + planted if target.exists() else planted)
    problems = forbidden_imports(tmp_path)
    assert any(message in p for p in problems), problems


def test_imports_under_type_checking_are_not_counted(tmp_path):
    (tmp_path / "agl_core" / "stages").mkdir(parents=True)
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "agl_core" / "rollouts").mkdir()
    (tmp_path / "agl_core" / "rollouts" / "events.py").write_text("")
    (tmp_path / "agl_core" / "stages" / "__init__.py").write_text("")
    (tmp_path / "agl_core" / "stages" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agl_core.rollouts.events import x\n"
    )
    assert forbidden_imports(tmp_path) == []
