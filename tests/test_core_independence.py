"""agl_core and agl_hooks import without verl or ray: a plugin author may test against the core alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_core_imports_with_verl_and_ray_unavailable():
    script = textwrap.dedent(
        """
        import importlib, importlib.abc, pkgutil, sys

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("verl", "ray"):
                    raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
                return None

        sys.meta_path.insert(0, Refuse())
        import agl_core, agl_hooks
        names = []
        for package in (agl_core, agl_hooks):
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                importlib.import_module(info.name)
                names.append(info.name)
        print(len(names))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 10
