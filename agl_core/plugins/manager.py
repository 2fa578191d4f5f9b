"""The plugin manager: discovery, registries and the rollout lifecycle hooks, behind a typed facade.

Discovery order (it is also the order in which lifecycle hooks run):

1. the built-ins in :data:`DEFAULT_PLUGINS`, registered as ordinary plugins;
2. distributions exposing an entry point in group ``agl``: agl's own always (the ``verl`` backend and
   ``hookfiles``, the hook-file loader from ``agl_hooks``), third-party ones unless the environment
   variable ``AGL_DISABLE_PLUGIN_AUTOLOAD`` is set to a true value;
3. hook files named in ``agentlightning.hooks``, each turned into a plugin by the
   ``agl_load_hook_file`` hook (:meth:`PluginManager.load_hook_files`);
4. plugin objects passed in code (:meth:`PluginManager.register`).

``AGL_BLOCKED_PLUGINS`` (comma-separated registration names) blocks plugins, built-ins included.
Callers never touch pluggy: they use the registry properties and the ``on_*``/``enqueue`` methods.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections import Counter
from importlib.metadata import packages_distributions
from pathlib import Path
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import pluggy

from agl_core import hookspecs
from agl_core.config import redacted
from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.plugins.event_writer import EventWriter
from agl_core.plugins.registry import Registry
from agl_core.suggestions import suggest

logger = logging.getLogger(__name__)

ENTRYPOINT_GROUP = "agl"
DISABLE_AUTOLOAD_ENV = "AGL_DISABLE_PLUGIN_AUTOLOAD"
BLOCKED_PLUGINS_ENV = "AGL_BLOCKED_PLUGINS"

# The built-in plugins: registration name -> module. The names are stable (they are what
# ``AGL_BLOCKED_PLUGINS`` and ``agl plugins`` use); the modules may move.
DEFAULT_PLUGINS: dict[str, str] = {
    "aggregators": "agl_core.stages.levels",
    "estimators": "agl_core.stages.estimators",
    "losses": "agl_core.stages.losses",
    "torch": "agl_core.backends.torch",
    "sinks": "agl_core.tracking.builtins",
}

# registry property -> (hook name, kind, config key selecting an entry)
REGISTRIES = {
    "aggregators": ("agl_register_aggregators", "aggregator", "agentlightning.trace_aggregator.level"),
    "advantage_estimators": ("agl_register_advantage_estimators", "advantage estimator", "algorithm.adv_estimator"),
    "policy_losses": ("agl_register_policy_losses", "policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode"),
    "backends": ("agl_register_backends", "backend", "agentlightning.backend"),
    "metric_sinks": ("agl_register_metric_sinks", "metric sink", "trainer.logger"),
}

HOOK_FAILURES_METRIC = "training/n_hook_failures"
# Events a hook queued before it raised: discarded (a failing hook writes nothing), and counted.
DISCARDED_HOOK_EVENTS_METRIC = "training/hooks/n_discarded_events"


class PluginError(Exception):
    """A plugin could not be loaded or does not fit the hook specifications."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def blocked_from_env() -> list[str]:
    return [name.strip() for name in os.environ.get(BLOCKED_PLUGINS_ENV, "").split(",") if name.strip()]


@attrs.frozen
class PluginInfo:
    """What ``agl plugins`` shows for one plugin."""

    name: str
    source: str
    hooks: tuple[str, ...]
    provides: dict[str, tuple[str, ...]]


class PluginManager:
    """agl's plugin manager. Build one per run with :meth:`from_config` or the constructor."""

    def __init__(
        self,
        *,
        load_entrypoints: bool | None = None,
        blocked: Iterable[str] = (),
        builtins: Mapping[str, str] | None = None,
    ):
        self._pm = pluggy.PluginManager("agl")
        self._pm.add_hookspecs(hookspecs)
        self._sources: dict[str, str] = {}
        self._registries: dict[str, Registry] = {}
        self.hook_failures: Counter[str] = Counter()
        self.discarded_hook_events = 0
        for name in [*blocked_from_env(), *blocked]:
            self._pm.set_blocked(name)
        for name, module_name in (DEFAULT_PLUGINS if builtins is None else builtins).items():
            if not self._pm.is_blocked(name):
                self.register(importlib.import_module(module_name), name=name, source="built-in")
        if load_entrypoints is None:
            load_entrypoints = not _env_flag(DISABLE_AUTOLOAD_ENV)
        self._load_entrypoints(third_party=load_entrypoints)
        self.check_pending()

    @classmethod
    def from_config(cls, config: Any, plugins: Iterable[Any] = (), **kwargs: Any) -> PluginManager:
        """A manager with built-ins, entry points, the config's hook files, then ``plugins``."""
        manager = cls(**kwargs)
        hooks = _select(config, "agentlightning.hooks")
        if hooks:
            manager.load_hook_files([hooks] if isinstance(hooks, str) else list(hooks))
        for plugin in plugins:
            manager.register(plugin)
        return manager

    # -- registration -------------------------------------------------------------------------

    def _load_entrypoints(self, *, third_party: bool) -> None:
        """Load the ``agl`` entry points: always agl's own (its distribution's: the verl backend, the
        hook-file loader), and third-party ones when ``third_party`` is true."""
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRYPOINT_GROUP):
            if self._pm.is_blocked(ep.name) or self._pm.get_plugin(ep.name) is not None:
                continue
            if not third_party and not _is_own(ep):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                dist = ep.dist.name if ep.dist else "unknown distribution"
                raise PluginError(f"entry point {ep.name!r} ({ep.value}) of {dist} failed to import: {exc}") from exc
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
            self.register(plugin, name=ep.name, source=f"entry point ({dist})")

    def load_hook_files(self, paths: Sequence[str | os.PathLike[str]]) -> list[str]:
        """Load user hook files as plugins through ``agl_load_hook_file``; return their names."""
        names = []
        for path in paths:
            resolved = Path(path).expanduser().resolve()
            plugin = self._pm.hook.agl_load_hook_file(path=resolved)
            if plugin is None:
                raise PluginError(
                    f"hook file {resolved}: no plugin loads hook files (agl_hooks provides the loader through "
                    f"the {ENTRYPOINT_GROUP!r} entry point; is agl installed, and is 'hookfiles' not blocked?)"
                )
            names.append(self.register(plugin, name=f"hookfile:{resolved}", source=f"hook file {resolved}"))
        return names

    def register(self, plugin: Any, name: str | None = None, *, source: str = "code") -> str:
        """Register a plugin object (module, class instance...); return its registration name."""
        _refuse_unknown_hooks(plugin, name)
        existing = self._pm.get_name(plugin)
        if existing is not None:
            raise PluginError(
                f"plugin {name or plugin!r} is already registered as {existing!r} "
                f"({self._sources.get(existing, 'code')}); register each plugin once"
            )
        try:
            registered = self._pm.register(plugin, name=name)
        except ValueError as exc:
            raise PluginError(str(exc)) from exc
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name or plugin!r} does not fit the hookspecs: {exc}") from exc
        if registered is None:  # blocked
            return name or ""
        self._sources[registered] = source
        self._registries.clear()
        return registered

    def unregister(self, name: str) -> None:
        self._pm.unregister(name=name)
        self._sources.pop(name, None)
        self._registries.clear()

    def check_pending(self) -> None:
        """Fail loudly if a plugin implements a hook that no spec defines (a misspelt name)."""
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(str(exc)) from exc

    def get_plugin(self, name: str) -> Any:
        """The plugin object registered under ``name`` (``None`` if there is none)."""
        return self._pm.get_plugin(name)

    def is_registered(self, name: str) -> bool:
        return self._pm.get_plugin(name) is not None

    def given_in_code(self) -> list[Any]:
        """The plugin objects passed in code (not built-ins, entry points or hook files), in
        registration order: what a backend that runs the hooks in another process must ship there."""
        return [self._pm.get_plugin(name) for name, source in self._sources.items() if source == "code"]

    # -- registries ---------------------------------------------------------------------------

    def _registry(self, prop: str) -> Registry:
        if prop not in self._registries:
            hook_name, kind, config_key = REGISTRIES[prop]
            registry = Registry(kind, config_key)
            for impl in _in_plugin_order(getattr(self._pm.hook, hook_name).get_hookimpls()):
                impl.function(lambda entry_name, obj, _p=impl.plugin_name: registry.add(entry_name, obj, _p))
            self._registries[prop] = registry
        return self._registries[prop]

    @property
    def aggregators(self) -> Registry:
        return self._registry("aggregators")

    @property
    def advantage_estimators(self) -> Registry:
        return self._registry("advantage_estimators")

    @property
    def policy_losses(self) -> Registry:
        return self._registry("policy_losses")

    @property
    def backends(self) -> Registry:
        return self._registry("backends")

    @property
    def metric_sinks(self) -> Registry:
        return self._registry("metric_sinks")

    # -- lifecycle hooks ----------------------------------------------------------------------

    def _call_each(self, hook_name: str, subject: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every implementation in plugin order, isolating failures; return (plugin, result)."""
        results = []
        writer = kwargs.get("writer")
        for impl in _in_plugin_order(getattr(self._pm.hook, hook_name).get_hookimpls()):
            mark = len(writer.pending) if writer is not None else 0
            try:
                result = impl.function(*[kwargs[arg] for arg in impl.argnames])
            except Exception:
                if writer is not None:
                    self.discarded_hook_events += writer.discard(keep=mark)
                self._record_failure(hook_name, impl.plugin_name, subject)
                continue
            results.append((impl.plugin_name, result))
        return results

    def _record_failure(self, hook_name: str, plugin_name: str, subject: str) -> None:
        self.hook_failures[hook_name] += 1
        logger.exception("hook %s of plugin %r failed (%s); training continues", hook_name, plugin_name, subject)

    def on_startup(self, config: Any) -> None:
        """Call every ``agl_on_startup`` with a copy of ``config`` whose secrets are redacted: no
        plugin ever sees the gateway key, whoever calls this."""
        self._call_each("agl_on_startup", "startup", config=redacted(config))

    def enqueue(self, request: RolloutRequest) -> RolloutRequest:
        """Pass ``request`` through every ``agl_on_enqueue`` in plugin order and return the result."""
        for impl in _in_plugin_order(self._pm.hook.agl_on_enqueue.get_hookimpls()):
            subject = f"rollout {request.rollout_id}"
            try:
                result = impl.function(*[{"request": request}[arg] for arg in impl.argnames])
                if result is None:
                    continue
                if not isinstance(result, RolloutRequest):
                    raise TypeError(f"agl_on_enqueue must return a RolloutRequest or None, got {type(result).__name__}")
                if (result.rollout_id, result.group_id) != (request.rollout_id, request.group_id):
                    raise ValueError("agl_on_enqueue may not change rollout_id or group_id")
            except Exception:
                self._record_failure("agl_on_enqueue", impl.plugin_name, subject)
                continue
            request = result
        return request

    def on_succeeded(self, rollout: CompletedRollout, events: dict[str, list[dict[str, Any]]], writer: EventWriter) -> None:
        self._call_each(
            "agl_on_succeeded", f"rollout {rollout.rollout_id}", rollout=rollout, events=events, writer=writer
        )

    def on_failed(self, rollout: CompletedRollout, writer: EventWriter) -> None:
        self._call_each("agl_on_failed", f"rollout {rollout.rollout_id}", rollout=rollout, writer=writer)

    def pop_metrics(self) -> dict[str, float]:
        """Hook-failure counts since the last call (``training/n_hook_failures[/hook]``) and the number
        of events discarded because the hook that queued them raised."""
        metrics: dict[str, float] = {
            HOOK_FAILURES_METRIC: float(sum(self.hook_failures.values())),
            DISCARDED_HOOK_EVENTS_METRIC: float(self.discarded_hook_events),
        }
        for hook_name, count in self.hook_failures.items():
            metrics[f"{HOOK_FAILURES_METRIC}/{hook_name}"] = float(count)
        self.hook_failures.clear()
        self.discarded_hook_events = 0
        return metrics

    # -- introspection ------------------------------------------------------------------------

    def list_plugins(self) -> list[PluginInfo]:
        """Every registered plugin with its source, the hooks it implements and the names it provides."""
        provides: dict[str, dict[str, list[str]]] = {}
        for prop in REGISTRIES:
            for entry in self._registry(prop):
                provides.setdefault(entry.plugin_name, {}).setdefault(prop, []).append(entry.name)
        infos = []
        for name, plugin in self._pm.list_name_plugin():
            if plugin is None:
                continue
            hooks = tuple(sorted(caller.name for caller in self._pm.get_hookcallers(plugin) or ()))
            infos.append(
                PluginInfo(
                    name=name,
                    source=self._sources.get(name, "code"),
                    hooks=hooks,
                    provides={k: tuple(v) for k, v in provides.get(name, {}).items()},
                )
            )
        return infos


def _in_plugin_order(impls: Sequence[Any]) -> list[Any]:
    """Registration order, ``tryfirst`` implementations first and ``trylast`` ones last.

    pluggy keeps implementations with the last registered at the end and calls from the end; agl's
    lifecycle hooks chain in discovery order instead (built-ins, then entry points, then hook files).
    """
    first = [i for i in impls if i.tryfirst]
    last = [i for i in impls if i.trylast]
    middle = [i for i in impls if not i.tryfirst and not i.trylast]
    return first + middle + last


KNOWN_HOOKS = tuple(name for name in dir(hookspecs) if name.startswith("agl_"))


def _refuse_unknown_hooks(plugin: Any, name: str | None) -> None:
    """Refuse a plugin with an ``agl_*`` attribute that no hookspec defines, suggesting the right name."""
    for attr in dir(plugin):
        if attr.startswith("agl_") and attr not in KNOWN_HOOKS and callable(getattr(plugin, attr, None)):
            raise PluginError(f"plugin {name or plugin!r} defines unknown hook {attr!r}; {suggest(attr, KNOWN_HOOKS)}")


@functools.cache
def _own_distributions() -> frozenset[str]:
    return frozenset(packages_distributions().get("agl_core", ()))


def _is_own(ep: Any) -> bool:
    """Whether entry point ``ep`` belongs to the distribution that installed ``agl_core``."""
    return ep.dist is not None and ep.dist.name in _own_distributions()


def _select(config: Any, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        if node is None:
            return None
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return node
