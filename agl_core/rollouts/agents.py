"""What running a contract agent in a thread of the trainer needs: its class and its environment.

An agent is ``agentlightning.local.agent_class`` (``module:Class``), run as ``Class().run()`` — the
controller's contract — with the contract's environment variables plus the ``local.env_map`` fields
of the rollout input. Environment variables are per process, but agents in threads share one: while
a :class:`ThreadEnviron` is installed, ``os.environ`` shows each agent thread its own variables over
the real environment (other threads see the real one), so agent code that reads ``os.environ`` runs
unchanged.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Iterator, Mapping, MutableMapping

from agl_core.config import ConfigError

__all__ = ["ThreadEnviron", "install_thread_environ", "load_agent_class", "uninstall_thread_environ"]


class ThreadEnviron(MutableMapping[str, str]):
    """``os.environ`` with a per-thread overlay: a thread inside :meth:`overlay` sees its own values."""

    def __init__(self, base: MutableMapping[str, str]):
        self.base = base
        self._local = threading.local()

    def _overlay(self) -> Mapping[str, str]:
        return getattr(self._local, "values", None) or {}

    def overlay(self, values: Mapping[str, str]) -> _Overlay:
        return _Overlay(self, values)

    def __getitem__(self, key: str) -> str:
        overlay = self._overlay()
        return overlay[key] if key in overlay else self.base[key]

    def __setitem__(self, key: str, value: str) -> None:
        self.base[key] = value

    def __delitem__(self, key: str) -> None:
        del self.base[key]

    def __iter__(self) -> Iterator[str]:
        overlay = self._overlay()
        yield from overlay
        yield from (k for k in self.base if k not in overlay)

    def __len__(self) -> int:
        return len(set(self.base) | set(self._overlay()))

    def copy(self) -> dict[str, str]:
        return dict(self)


class _Overlay:
    def __init__(self, environ: ThreadEnviron, values: Mapping[str, str]):
        self.environ, self.values = environ, dict(values)

    def __enter__(self) -> None:
        self.environ._local.values = self.values

    def __exit__(self, *exc: object) -> None:
        self.environ._local.values = None


_environ_lock = threading.Lock()
_environ_users = 0


def install_thread_environ() -> ThreadEnviron:
    """Put a :class:`ThreadEnviron` in place of ``os.environ`` (once, however many sources ask)."""
    global _environ_users
    with _environ_lock:
        if not isinstance(os.environ, ThreadEnviron):
            # Replacing the object is the point: code that reads os.environ must reach the overlay.
            os.environ = ThreadEnviron(os.environ)  # type: ignore[assignment]  # noqa: B003
        _environ_users += 1
        return os.environ  # type: ignore[return-value]


def uninstall_thread_environ() -> None:
    """Give ``os.environ`` back once the last source that installed the overlay is done."""
    global _environ_users
    with _environ_lock:
        _environ_users -= 1
        if _environ_users == 0 and isinstance(os.environ, ThreadEnviron):
            # Put the original mapping object back, untouched.
            os.environ = os.environ.base  # type: ignore[assignment]  # noqa: B003


def load_agent_class(path: str | None) -> type:
    """``module:Class`` (or ``module.Class``), imported from the working directory as the controller does."""
    key = "agentlightning.local.agent_class"
    if not path:
        raise ConfigError(key, "the embedded rollout source needs the agent class to run (module:Class)")
    module_name, _, class_name = path.partition(":") if ":" in path else path.rpartition(".")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        loaded = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(key, f"cannot import {path!r}: {exc}") from exc
    if not isinstance(loaded, type) or not callable(getattr(loaded, "run", None)):
        raise ConfigError(key, f"{path!r} must be a class with a run() method")
    return loaded
