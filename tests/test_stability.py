"""Stability for installed plugins: old module paths still import (with a warning naming the new
import), the stable surface never loses a name, and a broken installed plugin is reported, not a crash."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
import textwrap
import warnings

import pytest

from agl_core._moved import MOVED, REMOVED_IN, new_import
from agl_core.plugins import PluginError, PluginManager
from tests.helpers.paths import REPO_ROOT as REPO

STABLE = REPO / "tests" / "fixtures" / "stable_api.txt"

# What each moved module's __all__ held before layout v2 (git show 6538969^:agl_core/<module>.py).
PREVIOUS_PUBLIC = {
    "agl_core.advantage": "AdvantageError AdvantageSettings Advantages RolloutGroups group_rollouts "
    "grpo rloo reinforce reinforce_baseline turn_grpo",
    "agl_core.aggregation": "MISMATCH_KINDS Aggregation AggregationCounts AggregationSettings Mismatch Segment "
    "merged_row rollout_reward settings_from_config write_mismatches_jsonl",
    "agl_core.aggregators": "Align aggregate_trajectories exact_prefix trajectory transition",
    "agl_core.batch_shaping": "ShapingSettings ShapedBatch shape_batch",
    "agl_core.losses": "LossSettings PolicyLoss ppo_token_losses per_rollout_mean token_mean as_verl_policy_loss",
    "agl_core.mismatch": "MismatchLog classify_break common_prefix_length decode",
    "agl_core.normalization": "rollout_scales",
    "agl_core.tensorize": "PaddedBatch pad_responses padded_width tensorize",
    "agl_core.event_writer": "EventWriter PendingEvent",
    "agl_core.registry": "Registry RegistryEntry RegistryError",
    "agl_core.gateway_source": "rollout_config",
    "agl_core.embedded": "ThreadEnviron",
}


def fresh_import(name: str):
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [str(w.message) for w in caught if w.category is DeprecationWarning]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_imports_with_a_warning_naming_the_new_one(old):
    _, messages = fresh_import(old)
    assert any(f"{old} has moved to {MOVED[old][0]}" in m and REMOVED_IN in m for m in messages), messages


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_has_the_file_of_its_new_module(old):
    """``from agl_core.stages import levels; levels.__file__`` names the file its names come from."""
    module, _ = fresh_import(old)
    assert module.__file__ == importlib.import_module(MOVED[old][0]).__file__
    assert module.__spec__.origin == module.__file__


@pytest.mark.parametrize(
    ("old", "name"), [(old, name) for old, names in sorted(PREVIOUS_PUBLIC.items()) for name in names.split()]
)
def test_every_name_of_the_previous_release_is_still_there(old, name):
    module, _ = fresh_import(old)
    home, value = new_import(old, name)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} has moved: use 'from {home} import {name}'"):
        assert getattr(module, name) is value is getattr(importlib.import_module(home), name)


def test_a_plugin_written_against_the_previous_release_still_loads(tmp_path):
    """In a fresh interpreter, with warnings as pytest shows them: it imports, registers and runs."""
    (tmp_path / "old_plugin.py").write_text(
        textwrap.dedent("""
        from agl_core import hookimpl
        from agl_core.advantage import AdvantageSettings, grpo
        from agl_core.aggregation import Aggregation, AggregationCounts
        from agl_core.event_writer import EventWriter

        @hookimpl
        def agl_register_advantage_estimators(register):
            register("old_grpo", grpo)
    """)
    )
    script = (
        "import warnings; warnings.simplefilter('default')\n"
        "import old_plugin\n"
        "from agl_core.plugins import PluginManager\n"
        "m = PluginManager(load_entrypoints=False); m.register(old_plugin)\n"
        "print('registered', 'old_grpo' in m.advantage_estimators)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "registered True"
    assert (
        "DeprecationWarning: agl_core.advantage.grpo has moved: use 'from agl_core.builtins.estimators import grpo'"
        in out.stderr
    )
    assert (
        "DeprecationWarning: agl_core.event_writer.EventWriter has moved: use 'from agl_core import EventWriter'"
        in out.stderr
    )


def test_a_name_that_is_gone_says_so():
    module, _ = fresh_import("agl_core.events")
    with pytest.raises(AttributeError, match="agl_core.events.FAILED_ROLLOUT_POLICIES no longer exists"):
        module.FAILED_ROLLOUT_POLICIES  # noqa: B018


def test_the_table_points_at_modules_that_exist_and_old_paths_that_do_not():
    for old, homes in MOVED.items():
        for home in homes:
            importlib.import_module(home)
        parent, _, leaf = old.rpartition(".")
        assert not (REPO / parent.replace(".", "/") / f"{leaf}.py").exists(), f"{old} exists again: remove its row"
        assert not (REPO / parent.replace(".", "/") / leaf).is_dir(), f"{old} exists again: remove its row"


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
    from agl_core.run_config import resolve_config

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
