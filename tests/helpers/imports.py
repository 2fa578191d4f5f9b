"""What a module imports, read from its source: for the tests that hold code to the public API."""

from __future__ import annotations

import ast

# Modules of agl_core that are public as a whole (their __all__, CHANGELOG.md's stability policy).
PUBLIC_MODULES = (
    "agl_core",
    "agl_core.backends.lora",
    "agl_core.backends.micro_batching",
    "agl_core.backends.ppo",
    "agl_core.backends.precision",
)


def private_imports(source: str) -> list[str]:
    """Imports of agl modules other than the public ones (:data:`PUBLIC_MODULES`) and the test helpers
    ``agl_core.testing[.x]``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] not in ("agl_core", "agl_hooks", "agl_backend_verl"):
                continue
            public = module in PUBLIC_MODULES or (
                parts[:2] == ["agl_core", "testing"] and not any(p.startswith("_") for p in parts)
            )
            if not public:
                found.append(module)
    return found
