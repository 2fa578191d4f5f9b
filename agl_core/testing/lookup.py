"""How a contract finds the plugin under test: by name, in a manager of its own.

The manager holds the built-ins and the plugin objects the test lists, never third-party entry
points: a contract tests the code in front of it, whatever else is installed. A listed plugin that
is already registered (a built-in module, or one listed twice) is not registered again. A contract
class's ``plugin_settings`` (``{section: {key: value}}``, as under ``agentlightning.plugins``)
configure the plugins as a run config would.

:class:`PluginContract` is the base of every contract suite: before any test of the class draws an
example, an autouse fixture looks the plugin up, so a name that is not registered fails at once
(and once: the failure is remembered) instead of in every hypothesis example.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import pytest

from agl_core.errors import UsageTypeError
from agl_core.plugins import PluginManager

__all__ = ["PluginContract", "contract_manager", "registered"]

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
        try:
            if not name:
                raise UsageTypeError(
                    f"{contract.__name__} must set {name_attribute} to the name of the plugin under test"
                )
            manager = contract_manager(getattr(contract, "plugins", ()), getattr(contract, "plugin_settings", None))
            _FOUND[key] = getattr(manager, registry).get(name)
        except Exception as exc:
            _FOUND[key] = exc
    found = _FOUND[key]
    if isinstance(found, Exception):
        raise found
    return found


class PluginContract:
    """What every contract suite shares: the plugin under test, looked up by name before any test runs."""

    #: the registry the plugin is in (``"aggregators"``...) and the class attribute naming it.
    registry: ClassVar[str] = ""
    name_attribute: ClassVar[str] = ""
    #: plugin objects to register in code beside the built-ins (entry points are never loaded).
    plugins: ClassVar[tuple[Any, ...]] = ()
    #: the plugins' settings, as under ``agentlightning.plugins`` (``{section: {key: value}}``).
    plugin_settings: ClassVar[Mapping[str, Any]] = {}

    def plugin_under_test(self) -> Any:
        return registered(type(self), self.registry, getattr(self, self.name_attribute), self.name_attribute)

    @pytest.fixture(autouse=True)
    def _plugin_is_registered(self) -> None:
        """Fail before hypothesis generates anything when the plugin cannot be found."""
        self.plugin_under_test()
