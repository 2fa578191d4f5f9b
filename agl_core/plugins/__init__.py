"""The plugin system: the manager (discovery, blocking, failure isolation), registries, the event writer.

May import ``agl_core.data``, ``agl_core.config`` and ``agl_core.hookspecs``; never a stage, a source or a backend.
"""

from agl_core.plugins.calls import HookTimeout
from agl_core.plugins.event_writer import EventWriter, PendingEvent
from agl_core.plugins.manager import (
    BLOCKED_PLUGINS_ENV,
    DEFAULT_PLUGINS,
    DISABLE_AUTOLOAD_ENV,
    ENTRYPOINT_GROUP,
    PluginError,
    PluginInfo,
    PluginManager,
)
from agl_core.plugins.registry import Registry, RegistryEntry, RegistryError
from agl_core.plugins.settings import SETTINGS_KEY, PluginSettings

__all__ = [
    "BLOCKED_PLUGINS_ENV",
    "DEFAULT_PLUGINS",
    "DISABLE_AUTOLOAD_ENV",
    "ENTRYPOINT_GROUP",
    "EventWriter",
    "HookTimeout",
    "PendingEvent",
    "PluginError",
    "PluginInfo",
    "PluginManager",
    "PluginSettings",
    "Registry",
    "RegistryEntry",
    "RegistryError",
    "SETTINGS_KEY",
]
