"""The rollout sources' import rules: the gateway and embedded families never import each other, and
the modules both use import neither."""

from __future__ import annotations

import ast
from pathlib import Path

import agl_core.rollouts

PACKAGE = Path(agl_core.rollouts.__file__).parent
GATEWAY = {"gateway", "gateway_sync", "gateway_async", "gateway_client", "retry"}
EMBEDDED = {"embedded", "recorder", "agents"}
SHARED = {"source", "events", "finish"}


def rollout_imports(module: str) -> set[str]:
    """The ``agl_core.rollouts`` modules that ``module`` imports (at run time or for type checking)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    prefix = "agl_core.rollouts."
    return {name[len(prefix) :].split(".")[0] for name in names if name.startswith(prefix)}


def test_every_module_is_in_one_family():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == GATEWAY | EMBEDDED | SHARED


def test_gateway_and_embedded_sources_never_import_each_other():
    for module in GATEWAY:
        assert not rollout_imports(module) & EMBEDDED, module
    for module in EMBEDDED:
        assert not rollout_imports(module) & GATEWAY, module
    for module in SHARED:
        assert not rollout_imports(module) & (GATEWAY | EMBEDDED), module
