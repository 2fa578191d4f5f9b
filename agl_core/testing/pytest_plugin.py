"""pytest fixtures for agl plugin authors (loaded automatically through the ``pytest11`` entry point).

pytest loads this module in every project of an environment where agl is installed, so it imports
nothing beyond pytest at load time, and hypothesis only when it is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from agl_core.testing import has_hypothesis

if TYPE_CHECKING:
    from agl_core.plugins import PluginManager

if has_hypothesis():
    from hypothesis import settings

    # Select with ``--hypothesis-profile agl-thorough`` to run every contract property on 1,000 traces.
    settings.register_profile("agl-thorough", max_examples=1000, deadline=None)


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
