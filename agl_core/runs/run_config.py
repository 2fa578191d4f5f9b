"""The run's config and plugin manager, resolved once for ``agl train``, ``agl check`` and ``agl replay``.

The backend is read first (``agentlightning.backend`` from the overrides, else the YAML, else the
schema's default), so that the run is validated by that backend's ``load_config``
(:class:`~agl_core.backends.contract.BackendSpec`): verl's full config for ``verl``, the core schema
(:func:`~agl_core.config.load_config`) by default.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from agl_core.backends.contract import BackendSpec, backend_spec
from agl_core.config import ConfigFile
from agl_core.plugins import PluginManager

__all__ = ["registered_backend", "resolve_config"]


def resolve_config(
    config_path: str | ConfigFile | None, overrides: Sequence[str] = (), plugins: Iterable[Any] = ()
) -> tuple[Any, PluginManager]:
    """The run's validated config and its plugin manager (the hook files the config names loaded,
    ``plugins`` registered, the plugins' settings configured). The file is read once
    (:class:`~agl_core.config.ConfigFile`; one already made is taken as it is); an unknown key that
    another backend knows is an error naming that backend."""
    from omegaconf import OmegaConf

    from agl_core.config import ConfigError, default_config, read_config_file, with_backend_hint

    source = (
        config_path if config_path is None or isinstance(config_path, ConfigFile) else read_config_file(config_path)
    )
    raw = _unvalidated(source, overrides)
    hooks = OmegaConf.select(raw, "agentlightning.hooks", default=None, throw_on_resolution_failure=False)
    if not isinstance(hooks, str) and not (OmegaConf.is_list(hooks) and all(isinstance(h, str) for h in hooks)):
        hooks = None  # malformed: validation names the key
    manager = PluginManager.from_config({"agentlightning": {"hooks": hooks}}, plugins)
    manager.refuse_broken()
    name = OmegaConf.select(raw, "agentlightning.backend", default=None, throw_on_resolution_failure=False)
    name = default_config().agentlightning.backend if name is None else name
    try:
        config = registered_backend(manager, name).load_config(source, overrides)
    except ConfigError as exc:  # an unknown key may be one of another backend's: say which
        others = {e.name: backend_spec(e).load_config for e in manager.backends.entries() if e.name != name}
        raise with_backend_hint(exc, source, overrides, others) from None
    manager.hook_timeout_seconds = float(config.agentlightning.hook_timeout_seconds)
    manager.configure(config)  # the plugins' settings (agentlightning.plugins), validated
    return config, manager


def registered_backend(manager: PluginManager, name: str) -> BackendSpec:
    """The backend registered as ``name`` (an unknown name is an error naming ``agentlightning.backend``)."""
    return backend_spec(manager.backends.entry(name))


def _unvalidated(source: ConfigFile | None, overrides: Sequence[str]) -> Any:
    """The file's content with the overrides merged over it, unchecked; empty when the overrides
    cannot be read (the loader then reports why, naming the key)."""
    from omegaconf import OmegaConf

    try:
        user = source.content if source is not None else {}
        return OmegaConf.merge(user, OmegaConf.from_dotlist([o for o in overrides if "=" in o]))
    except Exception:
        return OmegaConf.create()
