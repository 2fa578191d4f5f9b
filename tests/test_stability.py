"""Stability for installed plugins: the stable surface never loses a name, importing agl installs no
import hook, and a broken installed plugin is reported, not a crash."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
import textwrap

import pytest

from agl_core.plugins import PluginError, PluginManager
from tests.helpers.paths import REPO_ROOT as REPO

STABLE = REPO / "tests" / "fixtures" / "stable_api.txt"


def test_no_global_import_hook_is_installed():
    """Before the first release a moved module has no alias: ``import agl_core`` leaves ``sys.meta_path``
    as it found it (CHANGELOG.md, Stability policy)."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; before = list(sys.meta_path); import agl_core; print(sys.meta_path == before)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "True"


def stable_names() -> list[tuple[str, str]]:
    lines = [line for line in STABLE.read_text().splitlines() if line and not line.startswith("#")]
    return [tuple(line.split(":")) for line in lines]  # type: ignore[misc]


@pytest.mark.parametrize(("module", "name"), stable_names(), ids=":".join)
def test_the_stable_surface_keeps_every_name(module, name):
    """Stability policy (CHANGELOG.md): a stable name is never removed or renamed without a
    deprecation period of one minor release; this list only grows."""
    loaded = importlib.import_module(module)
    if module != "agl_core.hookspecs":
        assert name in loaded.__all__, (
            f"{module}.{name} left __all__: stable names stay (see CHANGELOG.md, Stability policy)"
        )
    assert hasattr(loaded, name)


# -- a broken installed plugin -----------------------------------------------------------------


class BrokenEntryPoint:
    name, value, group = "shiny", "agl_shiny_missing:plugin", "agl"

    class dist:  # noqa: N801 (stands for a Distribution)
        name, version = "agl-shiny", "1.2.3"

    def load(self):
        import agl_shiny_missing  # noqa: F401


@pytest.fixture
def broken_installed(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [BrokenEntryPoint()])
    monkeypatch.delenv("AGL_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("AGL_BLOCKED_PLUGINS", raising=False)


def test_a_broken_entry_point_is_listed_with_its_error(broken_installed):
    manager = PluginManager()
    (info,) = manager.broken()
    assert info.name == "shiny" and info.error == "ModuleNotFoundError: No module named 'agl_shiny_missing'"
    assert info in manager.list_plugins() and "aggregators" in {i.name for i in manager.list_plugins()}
    with pytest.raises(
        PluginError,
        match=r"plugin 'shiny' \(entry point agl_shiny_missing:plugin \(agl-shiny 1.2.3\)\) failed to import: "
        r".*AGL_BLOCKED_PLUGINS=shiny",
    ):
        manager.refuse_broken()


def test_agl_plugins_lists_it_and_check_refuses_it(broken_installed, capsys):
    from agl_core.cli import main

    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert (
        "shiny  [entry point agl_shiny_missing:plugin (agl-shiny 1.2.3)]  BROKEN\n  error: ModuleNotFoundError" in out
    )
    assert "aggregators  [built-in]" in out
    assert main(["check", "examples/corridor/config.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "agl: error: plugin 'shiny' (entry point agl_shiny_missing:plugin (agl-shiny 1.2.3)) failed to import"
    )
    assert "AGL_BLOCKED_PLUGINS=shiny" in err


def test_blocking_it_lets_the_run_go_on(broken_installed, monkeypatch):
    from agl_core.runs.run_config import resolve_config

    monkeypatch.setenv("AGL_BLOCKED_PLUGINS", "shiny")
    config, manager = resolve_config("examples/corridor/config.yaml")
    assert manager.broken() == [] and config.agentlightning.backend == "torch"


def test_a_contract_on_an_unregistered_name_fails_before_any_example(tmp_path):
    """The lookup is an autouse fixture, remembered per class: every test errors in setup, before
    hypothesis draws an example, and the manager is built once."""
    (tmp_path / "test_missing.py").write_text(
        textwrap.dedent("""
        from agl_core.testing.contracts import AggregatorContract

        class TestMissing(AggregatorContract):
            aggregator_name = "not_registered_anywhere"
    """)
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_missing.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 1, out.stdout[-2000:]
    assert "errors" in out.stdout and " passed" not in out.stdout and " failed" not in out.stdout, out.stdout[-2000:]
    assert "ERROR at setup of TestMissing" in out.stdout
    assert "unknown aggregator 'not_registered_anywhere'" in out.stdout
    assert "Falsifying example" not in out.stdout
