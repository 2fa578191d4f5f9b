"""How a contract finds the plugin under test: by name, in a manager of its own.

The manager holds the built-ins and the plugin objects the test lists, never third-party entry
points: a contract tests the code in front of it, whatever else is installed. A listed plugin that
is already registered (a built-in module, or one listed twice) is not registered again. A contract
class's ``plugin_settings`` (``{section: {key: value}}``, as under ``agentlightning.plugins``)
configure the plugins as a run config would.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from agl_core.plugins import PluginManager

__all__ = ["contract_manager", "registered"]

_FOUND: dict[tuple[type, str], Any] = {}


def contract_manager(plugins: Iterable[Any] = (), plugin_settings: Mapping[str, Any] | None = None) -> PluginManager:
    """The built-ins plus ``plugins``, with third-party entry points off, configured with ``plugin_settings``."""
    manager = PluginManager(load_entrypoints=False)
    present = {id(manager.get_plugin(info.name)) for info in manager.list_plugins()}
    for plugin in plugins:
        if id(plugin) not in present:
            manager.register(plugin)
            present.add(id(plugin))
    manager.configure({"agentlightning": {"plugins": dict(plugin_settings or {})}})
    return manager


def registered(contract: type, registry: str, name: str, name_attribute: str) -> Any:
    """The entry ``name`` of ``registry`` (``"aggregators"``...) for test class ``contract``,
    looked up once per class in :func:`contract_manager` of the class's ``plugins``."""
    key = (contract, registry)
    if key not in _FOUND:
        if not name:
            raise TypeError(f"{contract.__name__} must set {name_attribute} to the name of the plugin under test")
        manager = contract_manager(getattr(contract, "plugins", ()), getattr(contract, "plugin_settings", None))
        _FOUND[key] = getattr(manager, registry).get(name)
    return _FOUND[key]
