"""Loading a run config: base → user YAML → ``key=value`` overrides, validated once; secrets redacted in dumps."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from agl_core.config.checks import validate
from agl_core.config.errors import ConfigError
from agl_core.config.schema import SECRET_KEYS, default_config

__all__ = ["REDACTED", "load_config", "redacted", "to_yaml"]

REDACTED = "***"


def _config_error(exc: OmegaConfBaseException, origin: str) -> ConfigError:
    key = str(getattr(exc, "full_key", "") or getattr(exc, "key", "") or "?")
    message = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]
    if key in SECRET_KEYS:
        message = "invalid value (not shown: it is a secret)"
    elif "not in struct" in message or "Key '" in message and "not in" in message:
        message = "unknown key"
    return ConfigError(key, f"{message} (in {origin})")


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    base: DictConfig | None = None,
) -> DictConfig:
    """Merge ``base`` (default: :func:`default_config`), the YAML file at ``path`` and ``key=value``
    overrides; validate; return the result with interpolations resolved."""
    cfg = default_config() if base is None else base
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError("<file>", f"config file not found: {path}")
        try:
            user = OmegaConf.load(path)
        except Exception as exc:
            raise ConfigError("<file>", f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(user, DictConfig):
            raise ConfigError("<file>", f"{path} must hold a mapping at the top level")
        cfg = _merge(cfg, user, str(path))
    if overrides:
        for item in overrides:
            if "=" not in item:
                raise ConfigError(item, "override must be written key=value")
        try:
            dotlist = OmegaConf.from_dotlist(list(overrides))
        except OmegaConfBaseException as exc:
            raise _config_error(exc, "overrides") from None
        cfg = _merge(cfg, dotlist, "overrides")
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise _config_error(exc, "interpolation") from None
    validate(cfg)
    return cfg


def _merge(cfg: DictConfig, other: DictConfig, origin: str) -> DictConfig:
    try:
        merged = OmegaConf.merge(cfg, other)
    except OmegaConfBaseException as exc:
        raise _config_error(exc, origin) from None
    assert isinstance(merged, DictConfig)
    OmegaConf.set_struct(merged, True)
    return merged


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
