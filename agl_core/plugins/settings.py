"""Plugin settings: typed sections a plugin declares, set under ``agentlightning.plugins.<section>``.

A plugin declares its settings with the ``agl_plugin_settings`` hook, returning ``{section: cls}``
where ``cls`` is a dataclass or attrs class whose every field has a default. Users set them in the
run config::

    agentlightning:
      plugins:
        retoken_merge:
          lookahead_tokens: 6

Every value is converted to the field's type and the class's own validation runs (``__post_init__``
or attrs validators); every error is a :class:`~agl_core.config.ConfigError` naming the full key. A
section no plugin declares, or a key its class does not have, is an error with a "did you mean".
Plugins receive the built instances (:class:`PluginSettings`, section → instance) as the
``settings`` argument of the registry hooks and of ``agl_on_startup``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from agl_core.config import ConfigError
from agl_core.suggestions import closest

__all__ = ["SETTINGS_KEY", "PluginSettings", "SettingsDeclaration", "build_settings", "settings_class_problem"]

SETTINGS_KEY = "agentlightning.plugins"


@attrs.frozen
class SettingsDeclaration:
    """One declared section: its class and the plugin that declared it."""

    section: str
    cls: type
    plugin_name: str


def _field_defaults(cls: Any) -> dict[str, bool] | None:
    """Field name -> whether it has a default, for a dataclass or attrs class (else ``None``)."""
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        missing = dataclasses.MISSING
        return {f.name: f.default is not missing or f.default_factory is not missing for f in dataclasses.fields(cls)}
    if isinstance(cls, type) and attrs.has(cls):
        return {a.name: a.default is not attrs.NOTHING for a in attrs.fields(cls)}
    return None


def settings_class_problem(section: Any, cls: Any, plugin_name: str) -> str | None:
    """Why a declaration cannot be a config section, naming the plugin; ``None`` when it can."""
    where = f"plugin {plugin_name!r} declares settings {section!r}"
    if not isinstance(section, str) or not section.isidentifier():
        return f"{where}: a section name must be an identifier"
    defaults = _field_defaults(cls)
    if defaults is None:
        return f"{where} as {cls!r}, which is neither a dataclass nor an attrs class; declare one of those"
    no_default = [name for name, has in defaults.items() if not has]
    if no_default:
        return f"{where}: field(s) {', '.join(no_default)} have no default; every setting needs one"
    return None


class PluginSettings(Mapping[str, Any]):
    """The run's plugin settings, read-only: section name -> the built settings instance."""

    __module__ = "agl_core"

    def __init__(self, values: Mapping[str, Any]):
        self._values = dict(values)

    def __getitem__(self, section: str) -> Any:
        try:
            return self._values[section]
        except KeyError:
            match = closest(str(section), self._values)
            hint = f"; did you mean {match!r}?" if match else ""
            raise KeyError(
                f"no plugin declares settings {section!r}{hint} (declared: {', '.join(sorted(self._values)) or 'none'})"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"PluginSettings({self._values!r})"


def _build_one(declaration: SettingsDeclaration, values: Any) -> Any:
    prefix = f"{SETTINGS_KEY}.{declaration.section}"
    if values is None:
        values = {}
    if not isinstance(values, (Mapping, DictConfig)):
        raise ConfigError(prefix, f"must be a mapping of settings, got {type(values).__name__}")
    try:
        node = OmegaConf.merge(OmegaConf.structured(declaration.cls), values)
        return OmegaConf.to_object(node)
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", "") or "")
        message = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]
        if "not in" in message and key:
            known = _field_defaults(declaration.cls)
            match = closest(key, known)
            message = f"unknown setting of plugin {declaration.plugin_name!r}" + (
                f"; did you mean {match!r}?" if match else f" (known: {', '.join(known)})"
            )
        raise ConfigError(f"{prefix}.{key}" if key else prefix, message) from None
    except (TypeError, ValueError) as exc:  # the class's own validation
        message = str(exc.args[0]) if exc.args else type(exc).__name__
        field = _named_field(exc, message, _field_defaults(declaration.cls))
        raise ConfigError(
            f"{prefix}.{field}" if field else prefix, f"{message} (plugin {declaration.plugin_name!r})"
        ) from None


def _named_field(exc: Exception, message: str, fields: Mapping[str, bool]) -> str | None:
    """The field a validation error is about: the attrs attribute it carries, else the first field
    its message names in quotes (attrs' validators and most ``__post_init__`` checks do)."""
    attribute = next((a for a in exc.args if isinstance(a, attrs.Attribute)), None)
    if attribute is not None:
        return attribute.name
    return next((name for name in fields if f"'{name}'" in message or message.startswith(f"{name} ")), None)


def build_settings(declarations: Mapping[str, SettingsDeclaration], section: Any) -> PluginSettings:
    """Every declared section built from ``section`` (the config's ``agentlightning.plugins``), or
    from its class's defaults where the config leaves it out."""
    given = (
        {}
        if section is None
        else (OmegaConf.to_container(section) if isinstance(section, DictConfig) else dict(section))
    )
    for name in given:
        if name not in declarations:
            match = closest(str(name), declarations)
            hint = f"did you mean {match!r}?" if match else f"declared: {', '.join(sorted(declarations)) or 'none'}"
            raise ConfigError(f"{SETTINGS_KEY}.{name}", f"no plugin declares these settings; {hint}")
    return PluginSettings({name: _build_one(d, given.get(name)) for name, d in declarations.items()})
