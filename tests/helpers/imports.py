"""What a module imports, read from its source: for the tests that hold code to the public API."""

from __future__ import annotations

import ast

# The modules the stable surface declares for backends besides the public API (CHANGELOG.md, Stability
# policy): the update toolkit, LoRA, dtypes, the batch module and dropout in the update.
BACKEND_TOOLKIT = (
    "agl_core.backends.ppo",
    "agl_core.backends.lora",
    "agl_core.backends.precision",
    "agl_core.backends.micro_batching",
    "agl_core.backends.dropout",
)
# Modules of agl_core that are public as a whole (their __all__).
PUBLIC_MODULES = ("agl_core", *BACKEND_TOOLKIT)


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
