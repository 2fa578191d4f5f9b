"""Builds the corridor example's tiny policy once per test session (shared by several test files)."""

from __future__ import annotations

import functools
import importlib.util
import tempfile
from pathlib import Path

from tests.helpers.paths import REPO_ROOT


def build_corridor_policy(out_dir: Path, seed: int = 0) -> Path:
    spec = importlib.util.spec_from_file_location(
        "corridor_build_policy", REPO_ROOT / "examples/corridor/build_policy.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(out_dir, seed)


@functools.cache
def shared_corridor_policy() -> Path:
    """The policy built once per process (seed 0, as the corridor recording's), in a temporary folder."""
    return build_corridor_policy(Path(tempfile.mkdtemp(prefix="agl-corridor-policy-")))
