"""pytest fixtures for agl plugin authors (loaded automatically through the ``pytest11`` entry point)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings

from agl_core.plugins import PluginManager
from agl_core.testing.harness import agl_training  # noqa: F401  (the integration-harness fixture)

# Select with ``--hypothesis-profile agl-thorough`` to run every contract property on 1,000 traces.
settings.register_profile("agl-thorough", max_examples=1000, deadline=None)


@pytest.fixture
def agl_plugin_manager_factory() -> Callable[..., PluginManager]:
    """Build isolated plugin managers: built-ins plus the plugins given, no entry-point autoload."""

    def make(*plugins: Any, load_entrypoints: bool = False) -> PluginManager:
        manager = PluginManager(load_entrypoints=load_entrypoints)
        for plugin in plugins:
            manager.register(plugin)
        return manager

    return make
