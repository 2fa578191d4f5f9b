"""The ``agl`` console script."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest



def agl(*args, env=None):
    exe = shutil.which("agl", path=str(Path(sys.executable).parent))
    assert exe, "the agl console script is installed with the package"
    return subprocess.run([exe, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120)


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    out = agl("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"agl {version('agl-backend-verl')}"


def test_version_falls_back_to_the_package_version_in_a_source_tree(monkeypatch):
    import importlib.metadata

    import agl_core
    from agl_core import cli

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.package_version() == agl_core.__version__


def test_plugins_lists_builtins_with_their_hooks_and_names():
    out = agl("plugins", env={"AGL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out.returncode == 0, out.stderr
    from agl_core.plugins import DEFAULT_PLUGINS

    assert DEFAULT_PLUGINS, "the built-in aggregators, estimators, losses and backend are plugins"
    for name in DEFAULT_PLUGINS:
        assert f"{name}  [built-in]" in out.stdout
    assert "aggregators: trajectory, transition" in out.stdout
    assert "policy_losses: per_rollout_mean, token_mean" in out.stdout
    assert "backends: torch" in out.stdout
    assert "[entry point" not in out.stdout, "autoload is off"


def test_plugins_shows_a_hook_file(tmp_path):
    hooks = tmp_path / "my_hooks.py"
    hooks.write_text("from agl_core import hookimpl\n\n@hookimpl\ndef agl_on_startup(config):\n    pass\n")
    out = agl("plugins", "--hooks", str(hooks), env={"AGL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out.returncode == 0, out.stderr
    assert f"hookfile:{hooks.resolve()}  [hook file {hooks}]" in out.stdout
    assert "hooks: agl_on_startup" in out.stdout


def test_bad_hook_file_is_a_one_line_error(tmp_path):
    out = agl("plugins", "--hooks", str(tmp_path / "nope.py"))
    assert out.returncode == 2
    assert out.stderr.startswith("agl: error: hook file not found")


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_prints_every_threads_stack():
    """A stuck ``agl train`` can be asked where each thread is."""
    script = (
        "import os, signal, threading, time\n"
        "from agl_core.cli import dump_stacks_on_sigusr1\n"
        "assert dump_stacks_on_sigusr1()\n"
        "threading.Thread(target=time.sleep, args=(30,), name='sleeper', daemon=True).start()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.5)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "Current thread 0x" in done.stderr and done.stderr.count("hread 0x") == 2  # the main thread and the sleeper
