"""Name tables filled by the ``agl_register_*`` hooks.

The host owns the table: a plugin only calls ``register(name, obj)``. A name registered twice, or an
entry that cannot be called, is an error naming the plugin; looking up an unknown name is an error
listing what is registered. A :class:`Registry` is a read-only mapping of name -> registered object
(``registry["trajectory"]``, ``"trajectory" in registry``, ``list(registry)``, ``registry.items()``);
``registry.get(name)`` without a default raises :class:`RegistryError` like ``registry[name]``
(a name a config selects must exist), with a default it returns the default;
:meth:`Registry.entry` / :meth:`Registry.entries` add the plugin that registered each name. What an
entry declares beside its function (a policy loss's
:class:`~agl_core.stages.policy_loss.PolicyLossSpec`) travels in the entry object itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from agl_core.errors import AglError
from agl_core.suggestions import closest

__all__ = ["Registry", "RegistryEntry", "RegistryError"]


class RegistryError(AglError, LookupError):
    """A registry name is unknown, or claimed by two plugins."""

    __module__ = "agl_core"

    hint = "agl plugins lists the registered plugins and what they provide"


@attrs.frozen
class RegistryEntry:
    """One registered name: the object and the plugin that registered it."""

    name: str
    obj: Any
    plugin_name: str


_NO_DEFAULT: Any = object()


class Registry(Mapping[str, Any]):
    """The entries of one kind (``aggregator``, ``advantage estimator``...): a read-only mapping of
    name -> registered object, in name order. Only the plugin manager adds to it."""

    def __init__(self, kind: str, config_key: str):
        self.kind = kind
        self.config_key = config_key
        self._entries: dict[str, RegistryEntry] = {}

    def add(self, name: str, obj: Any, plugin_name: str) -> None:
        if not isinstance(name, str) or not name:
            raise RegistryError(f"plugin {plugin_name!r} registered a {self.kind} with an invalid name {name!r}")
        if not callable(obj):
            raise RegistryError(
                f"plugin {plugin_name!r} registered {self.kind} {name!r} as {obj!r}, which cannot be called"
            )
        previous = self._entries.get(name)
        if previous is not None:
            raise RegistryError(
                f"{self.kind} {name!r} is registered by both plugin {previous.plugin_name!r} and plugin "
                f"{plugin_name!r}; block one of them (AGL_BLOCKED_PLUGINS) or rename its {self.kind}"
            )
        self._entries[name] = RegistryEntry(name, obj, plugin_name)

    def __getitem__(self, name: str) -> Any:
        return self.entry(name).obj

    def get(self, name: str, default: Any = _NO_DEFAULT) -> Any:
        """The object registered as ``name``; without ``default``, an unknown name is a
        :class:`RegistryError` naming the config key and the registered names."""
        if default is not _NO_DEFAULT and name not in self._entries:
            return default
        return self.entry(name).obj

    def entry(self, name: str) -> RegistryEntry:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "none"
            match = closest(str(name), self._entries)
            hint = f"; did you mean {match!r}?" if match else ""
            raise RegistryError(
                f"unknown {self.kind} {name!r} (set by {self.config_key}); registered: {known}{hint}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def entries(self) -> list[RegistryEntry]:
        """Every entry (name, object, plugin), in name order."""
        return [self._entries[name] for name in self.names()]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"<Registry of {self.kind}s: {', '.join(self.names()) or 'none'}>"

    def __len__(self) -> int:
        return len(self._entries)
