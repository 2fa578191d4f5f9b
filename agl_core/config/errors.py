"""The one error every config check raises: :class:`ConfigError`, naming the key path."""

from __future__ import annotations

from agl_core.errors import AglError

__all__ = ["ConfigError"]


class ConfigError(AglError, ValueError):
    """A config value is missing, unknown, of the wrong type or inconsistent; ``key`` is its path."""

    __module__ = "agl_core"

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"config key {key}: {message}")
