"""pytest fixtures for agl plugin authors (loaded automatically through the ``pytest11`` entry point).

pytest loads this module in every project of an environment where agl is installed, so it imports
nothing beyond pytest and ``agl_core``'s two-module root at load time: each fixture imports what it
needs when it is used, and hypothesis is imported only to register agl's profiles when a run asks
for one of them (``--hypothesis-profile agl-fast``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pathlib import Path

    from agl_core.plugins import PluginManager
    from agl_core.testing.harness import TrainingRun

#: ``--hypothesis-profile agl-fast``: 20 examples per contract property, for CI on every change;
#: ``--hypothesis-profile agl-thorough``: 1,000, before a release (ten times the default's cost).
PROFILES = {"agl-fast": 20, "agl-thorough": 1000}


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Register agl's hypothesis profiles before hypothesis's own plugin loads the one asked for."""
    asked = config.getoption("hypothesis_profile", default=None)
    if asked in PROFILES:
        from hypothesis import settings

        for name, examples in PROFILES.items():
            settings.register_profile(name, max_examples=examples, deadline=None)


@pytest.fixture
def agl_plugin_manager_factory() -> Callable[..., PluginManager]:
    """Build isolated plugin managers: built-ins plus the plugins given, no entry-point autoload."""
    from agl_core.plugins import PluginManager

    def make(*plugins: Any, load_entrypoints: bool = False) -> PluginManager:
        manager = PluginManager(load_entrypoints=load_entrypoints)
        for plugin in plugins:
            manager.register(plugin)
        return manager

    return make


@pytest.fixture
def agl_training(tmp_path: Path) -> Callable[..., TrainingRun]:
    """Real training steps of the reference backend on a tiny built-in task, each run under
    ``tmp_path``: ``agl_training(plugins=[...], overrides={...}, steps=2)`` returns a
    :class:`~agl_core.testing.harness.TrainingRun` (see :func:`~agl_core.testing.harness.run_training`)."""
    from agl_core.testing.harness import training_runner

    return training_runner(tmp_path)
