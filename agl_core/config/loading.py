"""Loading a run config: base → user YAML → ``key=value`` overrides, validated once; secrets redacted in dumps.

Every failure is a :class:`ConfigError` naming the key: omegaconf's own errors often name none (a
merge of a list into a mapping, an interpolation that cannot be resolved), so the key is found by
comparing the two configs or resolving one interpolation at a time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import BooleanNode

from agl_core.config.checks import validate
from agl_core.config.composition import strip_composition
from agl_core.config.errors import ConfigError
from agl_core.config.refused import refuse_unhonoured
from agl_core.config.schema import SECRET_KEYS, default_config
from agl_core.suggestions import closest

__all__ = [
    "REDACTED",
    "ConfigFile",
    "load_config",
    "merge_config",
    "read_config_file",
    "redacted",
    "to_yaml",
    "with_backend_hint",
]

REDACTED = "***"


@attrs.frozen
class ConfigFile:
    """A run config file, read once (``read_config_file``): ``agl train`` and ``agl check`` hand it
    to the backend's loader (and to the other backends' when looking for a key's backend), so the
    file is read a single time per command. Every loader accepts one where it accepts a path."""

    path: str
    content: DictConfig

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any] | DictConfig, origin: str) -> ConfigFile:
        """A config held in memory (a dict, or a ``DictConfig`` such as Hydra composes) as if read from a
        file: loaded as the file would be, its errors saying ``(in origin)``. The content is copied
        with its interpolations unresolved, so the caller's object is never changed."""
        if not isinstance(config, (Mapping, DictConfig)):
            raise ConfigError(
                "<config>", f"{origin} must be a mapping (a dict or a DictConfig), got {type(config).__name__}"
            )
        plain = OmegaConf.to_container(config, resolve=False) if isinstance(config, DictConfig) else dict(config)
        try:
            content = OmegaConf.create(plain)
        except OmegaConfBaseException as exc:
            raise _config_error(exc, origin) from None
        return cls(origin, content)


def read_config_file(path: str | os.PathLike[str]) -> ConfigFile:
    """The YAML mapping at ``path``; a :class:`ConfigError` (key ``<file>``) when it cannot be read."""
    if os.path.isdir(path):
        raise ConfigError("<file>", f"{path} is a directory; expected a YAML config file")
    if not os.path.isfile(path):
        raise ConfigError("<file>", f"config file not found: {path}")
    try:
        content = OmegaConf.load(path)
    except Exception as exc:
        raise ConfigError("<file>", f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(content, DictConfig):
        raise ConfigError("<file>", f"{path} must hold a mapping at the top level")
    return ConfigFile(str(path), content)


def _config_error(exc: OmegaConfBaseException, origin: str, known: DictConfig | None = None) -> ConfigError:
    key = str(getattr(exc, "full_key", "") or getattr(exc, "key", "") or "?")
    message = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]
    if key in SECRET_KEYS:
        message = "invalid value (not shown: it is a secret)"
    elif "not in struct" in message or "Key '" in message and "not in" in message:
        message = f"unknown key (in {origin}){_did_you_mean(key, known)}"
        return ConfigError(key, message)
    return ConfigError(key, f"{message} (in {origin})")


def _did_you_mean(key: str, known: DictConfig | None) -> str:
    parent, _, name = key.rpartition(".")
    section = OmegaConf.select(known, parent) if known is not None and parent else known
    match = closest(name, section.keys()) if isinstance(section, DictConfig) else None
    return f"; did you mean {match!r}?" if match else ""


def load_config(
    path: str | os.PathLike[str] | ConfigFile | None = None,
    overrides: Sequence[str] = (),
    base: DictConfig | None = None,
) -> DictConfig:
    """Merge ``base`` (default: :func:`default_config`), the YAML file at ``path`` (or the
    :class:`ConfigFile` already read) and ``key=value`` overrides; validate; return the result with
    interpolations resolved."""
    cfg = merge_config(path, overrides, base)
    validate(cfg)
    return cfg


def merge_config(
    path: str | os.PathLike[str] | ConfigFile | None = None,
    overrides: Sequence[str] = (),
    base: DictConfig | None = None,
    composed: Sequence[str] = (),
) -> DictConfig:
    """:func:`load_config` without the cross-key checks, for a backend that checks its own keys' types
    first (every error is still a :class:`ConfigError` naming the key). ``composed``: the Hydra configs
    ``base`` holds, which the file's ``defaults`` may name (see :mod:`agl_core.config.composition`)."""
    cfg = default_config() if base is None else base
    if path is not None:
        file = path if isinstance(path, ConfigFile) else read_config_file(path)
        cfg = _merge(cfg, strip_composition(file.content, file.path, composed), file.path)
    if overrides:
        cfg = _merge(cfg, _parse_overrides(overrides), "overrides")
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise _interpolation_error(cfg, exc) from None
    return cfg


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(item, "override must be written key=value")
        if not key:
            raise ConfigError("<override>", f"{item!r} names no key: write key=value")
        if "" in key.split("."):
            raise ConfigError(key, f"is not a key path (an empty part between dots, in override {item!r})")
        if not value:
            raise ConfigError(
                key, f"override {item!r} has no value: write {key}=null to unset it, or {key}='' for an empty string"
            )
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as exc:
        raise _config_error(exc, "overrides") from None


def _merge(cfg: DictConfig, other: DictConfig, origin: str) -> DictConfig:
    refuse_unhonoured(other, cfg, origin)
    _refuse_non_bools(cfg, other, origin)
    try:
        merged = OmegaConf.merge(cfg, other)
    except OmegaConfBaseException as exc:
        conflict = _shape_conflict(cfg, other)
        if conflict is not None:
            key, expected, got = conflict
            raise ConfigError(key, f"must be {expected}, got {got} (in {origin})") from None
        raise _config_error(exc, origin, cfg) from None
    assert isinstance(merged, DictConfig)
    OmegaConf.set_struct(merged, True)
    return merged


def _refuse_non_bools(cfg: DictConfig, other: DictConfig, origin: str, prefix: str = "") -> None:
    """A key the schema types as a bool takes ``true`` or ``false`` only (YAML's ``yes``/``on`` are its
    spellings of true): OmegaConf would read ``2`` as true, and the word ``maybe`` as an error of its own."""
    if cfg._is_none() or cfg._is_missing():
        return  # a section that is null (or ???) holds no typed key yet
    for key in other:
        value, target = other._get_node(key), cfg._get_node(key) if key in cfg else None
        if isinstance(value, DictConfig):
            if isinstance(target, DictConfig):
                _refuse_non_bools(target, value, origin, f"{prefix}{key}.")
            continue
        raw = value._value()
        if isinstance(target, BooleanNode) and not (
            raw is None or isinstance(raw, bool) or (isinstance(raw, str) and raw.startswith("${"))
        ):
            raise ConfigError(f"{prefix}{key}", f"must be true or false, got {raw!r} (in {origin})")


def _shape(node: Any) -> str:
    if isinstance(node, DictConfig):
        return "a mapping (key: value)"
    if isinstance(node, ListConfig):
        return "a list"
    return "a single value"


def _shape_conflict(base: DictConfig, other: DictConfig, prefix: str = "") -> tuple[str, str, str] | None:
    """``(key, what base holds there, what other gives)`` for the first key where a mapping meets a
    list or a single value (or the other way round), which omegaconf reports without the key."""
    for key in other.keys():
        if key not in base or OmegaConf.is_interpolation(base, key) or OmegaConf.is_interpolation(other, key):
            continue
        mine, theirs = base._get_node(key), other._get_node(key)
        if mine is None or theirs is None or mine._is_none() or theirs._is_none():
            continue
        if isinstance(mine, DictConfig) and isinstance(theirs, DictConfig):
            found = _shape_conflict(mine, theirs, f"{prefix}{key}.")
            if found is not None:
                return found
        elif isinstance(mine, DictConfig) != isinstance(theirs, DictConfig):
            shown = (
                "(not shown: it is a secret)"
                if f"{prefix}{key}" in SECRET_KEYS
                else repr(OmegaConf.to_container(other)[key])
            )
            return f"{prefix}{key}", _shape(mine), f"{_shape(theirs)} {shown}"
    return None


def _interpolations(node: DictConfig | ListConfig, prefix: str = "") -> Iterator[tuple[str, Callable[[], Any]]]:
    """``(dotted key, resolve)`` for every interpolation under ``node``."""
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        dotted = f"{prefix}{key}" if isinstance(node, DictConfig) else f"{prefix.rstrip('.')}[{key}]"
        if OmegaConf.is_interpolation(node, key):
            yield dotted, lambda node=node, key=key: node[key]
            continue
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_none() and not child._is_missing():
            yield from _interpolations(child, f"{dotted}.")


def _interpolation_error(cfg: DictConfig, exc: OmegaConfBaseException) -> ConfigError:
    """The error of the first interpolation that cannot be resolved, naming its key."""
    key, error = "?", exc
    for dotted, resolve in _interpolations(cfg):
        try:
            resolve()
        except OmegaConfBaseException as failed:
            key, error = dotted, failed
            break
    message = (getattr(error, "msg", None) or str(error)).splitlines()[0]
    if key in SECRET_KEYS:
        variable = re.search(r"Environment variable '([^']+)' not found", message)
        message = (
            f"environment variable {variable.group(1)!r} is not set"
            if variable
            else "details not shown: it is a secret"
        )
    return ConfigError(key, f"its interpolation cannot be resolved: {message}")


def with_backend_hint(
    error: ConfigError,
    path: str | os.PathLike[str] | ConfigFile | None,
    overrides: Sequence[str],
    loaders: Mapping[str, Callable[[Any, Sequence[str]], DictConfig]],
) -> ConfigError:
    """``error`` (an unknown key under one backend) with a hint naming the backend among ``loaders``
    (backend name → its config loader) that knows the key: the run's config loads under it, or its
    defaults hold the key (the config may have other problems there, reported once that backend is
    chosen). Where that backend says the key moved, its message is given."""
    if not error.message.startswith("unknown key"):
        return error
    for name, loader in loaders.items():
        hint = f"it is a key of backend {name!r}: run with backend={name}"
        try:
            loader(path, [*overrides, f"agentlightning.backend={name}"])
        except ConfigError as other:
            if other.key == error.key and "; moved to " in other.message:
                return ConfigError(error.key, f"{other.message}, under backend {name!r}: run with backend={name}")
            if other.key == error.key or (
                other.message.startswith("unknown key") and not _holds(loader, name, error.key)
            ):
                continue  # that backend does not know the key either (or it is not clear that it does)
        except Exception:
            continue
        return ConfigError(error.key, f"{error.message}; {hint}")
    return error


def _holds(loader: Callable[[Any, Sequence[str]], DictConfig], backend: str, key: str) -> bool:
    """Whether ``backend``'s default config (what ``loader`` gives without a file) has ``key``."""
    try:
        defaults = loader(None, [f"agentlightning.backend={backend}"])
    except Exception:
        return False
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(defaults, parent) if parent else defaults
    return isinstance(node, DictConfig) and name in node


def redacted(cfg: DictConfig | Mapping[str, Any]) -> DictConfig:
    """A copy of ``cfg`` (a config or a plain mapping) with every secret replaced by ``***`` (empty
    secrets stay empty)."""
    copy = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else dict(cfg))
    for key in SECRET_KEYS:
        if OmegaConf.select(copy, key):
            OmegaConf.update(copy, key, REDACTED)
    return copy


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(redacted(cfg))
