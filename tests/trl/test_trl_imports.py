"""agl_backend_trl is a backend outside the core: it imports only agl's public API (``agl_core`` and
the update toolkit ``agl_core.backends.ppo``), as agl_backend_verl does, and registering it loads no TRL."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.imports import private_imports
from tests.helpers.paths import REPO_ROOT


@pytest.mark.parametrize("path", sorted(p.name for p in (REPO_ROOT / "agl_backend_trl").glob("*.py")))
def test_the_trl_backend_imports_only_the_public_api(path):
    assert private_imports((REPO_ROOT / "agl_backend_trl" / path).read_text()) == []


def test_registering_the_backend_loads_no_trl_nor_torch():
    script = "import sys, agl_backend_trl.plugin; print('trl' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
