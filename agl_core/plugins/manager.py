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

The manager calls each implementation of agl's registry and lifecycle hooks on its own, so that one
plugin's failure cannot stop the others, and each lifecycle call is bounded in time
(``agentlightning.hook_timeout_seconds``: a call that overruns is abandoned, logged with its plugin's
name and counted as a failure; that plugin's hook is skipped until the call returns). pluggy's hook
wrappers (``wrapper=True`` / ``hookwrapper=True``) wrap a whole chain of calls, which this does not
make: they are refused when the plugin registers.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Iterable, Mapping, Sequence
from importlib.metadata import packages_distributions
from pathlib import Path
from typing import Any

import attrs
import pluggy

from agl_core import hookspecs
from agl_core.config import AgentLightningConfig, redacted
from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.errors import AglError
from agl_core.plugins.calls import HookCalls, env_flag, in_plugin_order, wrapper_impls
from agl_core.plugins.event_writer import EventWriter
from agl_core.plugins.registry import Registry
from agl_core.plugins.settings import (
    SETTINGS_KEY,
    PluginSettings,
    SettingsDeclaration,
    build_settings,
    settings_class_problem,
)
from agl_core.suggestions import suggest

ENTRYPOINT_GROUP = "agl"
DISABLE_AUTOLOAD_ENV = "AGL_DISABLE_PLUGIN_AUTOLOAD"
BLOCKED_PLUGINS_ENV = "AGL_BLOCKED_PLUGINS"

# The built-in plugins (agl_core/builtins/): registration name -> module. The names are stable (they
# are what ``AGL_BLOCKED_PLUGINS`` and ``agl plugins`` use); the modules may move.
DEFAULT_PLUGINS: dict[str, str] = {
    "aggregators": "agl_core.builtins.aggregators",
    "estimators": "agl_core.builtins.estimators",
    "losses": "agl_core.builtins.losses",
    "torch": "agl_core.builtins.backends",
    "sinks": "agl_core.builtins.sinks",
}

# registry property -> (hook name, kind, config key selecting an entry)
REGISTRIES = {
    "aggregators": ("agl_register_aggregators", "aggregator", "agentlightning.trace_aggregator.level"),
    "advantage_estimators": ("agl_register_advantage_estimators", "advantage estimator", "algorithm.adv_estimator"),
    "policy_losses": ("agl_register_policy_losses", "policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode"),
    "backends": ("agl_register_backends", "backend", "agentlightning.backend"),
    "metric_sinks": ("agl_register_metric_sinks", "metric sink", "trainer.logger"),
}

DEFAULT_HOOK_TIMEOUT_SECONDS = AgentLightningConfig.hook_timeout_seconds
# What agl_on_enqueue may not change: the ids the trainer tracks a rollout by and its place in the batch.
FIXED_REQUEST_FIELDS = ("rollout_id", "group_id", "step", "sample_index")
# The hook pluggy itself calls (firstresult), where hook wrappers work as pluggy documents.
PLUGGY_CALLED_HOOKS = ("agl_load_hook_file",)


class PluginError(AglError):
    """A plugin could not be loaded or does not fit the hook specifications."""

    __module__ = "agl_core"


def blocked_from_env() -> list[str]:
    return [name.strip() for name in os.environ.get(BLOCKED_PLUGINS_ENV, "").split(",") if name.strip()]


@attrs.frozen
class PluginInfo:
    """What ``agl plugins`` shows for one plugin."""

    name: str
    source: str
    hooks: tuple[str, ...]
    provides: dict[str, tuple[str, ...]]
    #: why the plugin could not be loaded (an entry point that fails to import); None when it works.
    error: str | None = None


class PluginManager:
    """agl's plugin manager. Build one per run with :meth:`from_config` or the constructor."""

    __module__ = "agl_core"

    def __init__(
        self,
        *,
        load_entrypoints: bool | None = None,
        blocked: Iterable[str] = (),
        builtins: Mapping[str, str] | None = None,
        hook_timeout_seconds: float = DEFAULT_HOOK_TIMEOUT_SECONDS,
    ):
        self._pm = pluggy.PluginManager("agl")
        self.calls = HookCalls(hook_timeout_seconds)
        self._pm.add_hookspecs(hookspecs)
        self._sources: dict[str, str] = {}
        self._registries: dict[str, Registry] = {}
        self._settings_section: Any = None  # the config's agentlightning.plugins, once configured
        self._settings: PluginSettings | None = None
        self._broken: dict[str, PluginInfo] = {}  # entry points that failed to import, by name
        for name in [*blocked_from_env(), *blocked]:
            self._pm.set_blocked(name)
        for name, module_name in (DEFAULT_PLUGINS if builtins is None else builtins).items():
            if not self._pm.is_blocked(name):
                self.register(importlib.import_module(module_name), name=name, source="built-in")
        if load_entrypoints is None:
            load_entrypoints = not env_flag(DISABLE_AUTOLOAD_ENV)
        self._load_entrypoints(third_party=load_entrypoints)
        self.check_pending()

    @property
    def hook_timeout_seconds(self) -> float:
        """The longest a lifecycle hook call is waited for (``agentlightning.hook_timeout_seconds``)."""
        return self.calls.timeout

    @hook_timeout_seconds.setter
    def hook_timeout_seconds(self, seconds: float) -> None:
        self.calls.timeout = seconds

    @classmethod
    def from_config(cls, config: Any, plugins: Iterable[Any] = (), **kwargs: Any) -> PluginManager:
        """A manager with built-ins, entry points, the config's hook files, then ``plugins``; lifecycle
        hook calls bounded by the config's ``agentlightning.hook_timeout_seconds`` when it has one."""
        timeout = _select(config, "agentlightning.hook_timeout_seconds")
        if timeout is not None:
            kwargs.setdefault("hook_timeout_seconds", float(timeout))
        manager = cls(**kwargs)
        hooks = _select(config, "agentlightning.hooks")
        if hooks:
            manager.load_hook_files([hooks] if isinstance(hooks, str) else list(hooks))
        for plugin in plugins:
            manager.register(plugin)
        manager.configure(config)
        return manager

    def configure(self, config: Any) -> None:
        """Take the plugin settings of ``config`` (``agentlightning.plugins``), validated now: a
        :class:`~agl_core.config.ConfigError` names the first wrong key."""
        self._settings_section = _select(config, SETTINGS_KEY)
        self._settings = None
        self._registries.clear()
        self.settings  # noqa: B018 (validates)

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
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
            try:
                plugin = ep.load()
            except Exception as exc:  # listed as broken; check and train refuse it (refuse_broken)
                error = f"{type(exc).__name__}: {exc}"
                self._broken[ep.name] = PluginInfo(ep.name, f"entry point {ep.value} ({dist})", (), {}, error)
                continue
            self.register(plugin, name=ep.name, source=f"entry point ({dist})")

    def broken(self) -> list[PluginInfo]:
        """The entry points that failed to import (``error`` says why), by name."""
        return [self._broken[name] for name in sorted(self._broken)]

    def refuse_broken(self) -> None:
        """Raise :class:`PluginError` naming the first entry point that failed to import and how to
        block it: a run must not go on without a plugin its environment installs."""
        for info in self.broken():
            raise PluginError(
                f"plugin {info.name!r} ({info.source}) failed to import: {info.error}; fix or uninstall it, "
                f"or block it with {BLOCKED_PLUGINS_ENV}={info.name}"
            )

    def load_hook_files(self, paths: Sequence[str | os.PathLike[str]]) -> list[str]:
        """Load user hook files as plugins through ``agl_load_hook_file``; return their names."""
        names: list[str] = []
        for path in paths:
            resolved = Path(path).expanduser().resolve()
            if f"hookfile:{resolved}" in names or self._pm.has_plugin(f"hookfile:{resolved}"):
                raise PluginError(
                    f"hook file {resolved} is listed twice in agentlightning.hooks; list each hook file once"
                )
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
        if name is None and not isinstance(getattr(plugin, "__name__", None), str):
            name = self._instance_name(plugin)
        try:
            registered = self._pm.register(plugin, name=name)
        except ValueError as exc:
            if name is not None and self._pm.has_plugin(name):  # pluggy's own message lists every plugin
                source = self._sources.get(name, "code")
                raise PluginError(
                    f"a plugin named {name!r} is already registered ({source}); register this one under another name"
                ) from None
            raise PluginError(str(exc)) from exc
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name or plugin!r} does not fit the hookspecs: {exc}") from exc
        if registered is None:  # blocked
            return name or ""
        self._refuse_wrappers(plugin, registered)
        self._sources[registered] = source
        self._registries.clear()
        self._settings = None
        return registered

    def _instance_name(self, plugin: Any) -> str:
        """The name of an object registered without one: its class's dotted path (numbered from the
        second instance), so hook failures and listings name it rather than pluggy's ``str(id(...))``."""
        base = f"{type(plugin).__module__}.{type(plugin).__qualname__}"
        name, number = base, 1
        while self._pm.has_plugin(name) or self._pm.is_blocked(name):
            number += 1
            name = f"{base}#{number}"
        return name

    def _refuse_wrappers(self, plugin: Any, name: str) -> None:
        """Unregister ``plugin`` and raise if it implements one of the hooks the manager calls one
        implementation at a time as a pluggy wrapper (it would silently wrap nothing)."""
        for hook_name, kind in wrapper_impls(self._pm, plugin, skip=PLUGGY_CALLED_HOOKS):
            self._pm.unregister(plugin)
            raise PluginError(
                f"plugin {name!r}: {hook_name} is a hook wrapper ({kind}); agl calls each implementation of its "
                "hooks on its own (isolating failures and bounding their time), so wrappers are not supported: "
                "write a plain @hookimpl (tryfirst/trylast set its place in the order)"
            )

    def unregister(self, name: str) -> None:
        self._pm.unregister(name=name)
        self._sources.pop(name, None)
        self._registries.clear()
        self._settings = None

    def check_pending(self) -> None:
        """Fail loudly if a plugin implements a hook that no spec defines (a misspelt name)."""
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(str(exc)) from exc

    def get_plugin(self, name: str) -> Any:
        """The plugin object registered under ``name`` (``None`` if there is none)."""
        return self._pm.get_plugin(name)

    def implementations(self, hook_name: str) -> list[str]:
        """The plugins implementing ``hook_name``, in the order they are called."""
        return [impl.plugin_name for impl in in_plugin_order(getattr(self._pm.hook, hook_name).get_hookimpls())]

    def given_in_code(self) -> list[Any]:
        """The plugin objects passed in code (not built-ins, entry points or hook files), in
        registration order: what a backend that runs the hooks in another process must ship there."""
        return [self._pm.get_plugin(name) for name, source in self._sources.items() if source == "code"]

    # -- settings -----------------------------------------------------------------------------

    def settings_declarations(self) -> dict[str, SettingsDeclaration]:
        """Every settings section the plugins declare (``agl_plugin_settings``), by section name."""
        declared: dict[str, SettingsDeclaration] = {}
        for impl in in_plugin_order(self._pm.hook.agl_plugin_settings.get_hookimpls()):
            classes = impl.function()
            if not isinstance(classes, Mapping):
                raise PluginError(
                    f"plugin {impl.plugin_name!r}: agl_plugin_settings must return {{section: settings class}}, got "
                    f"{classes!r}"
                )
            for section, cls in classes.items():
                problem = settings_class_problem(section, cls, impl.plugin_name)
                if problem is not None:
                    raise PluginError(problem)
                if section in declared:
                    raise PluginError(
                        f"settings {section!r} are declared by both plugin {declared[section].plugin_name!r} and "
                        f"plugin {impl.plugin_name!r}; block one of them ({BLOCKED_PLUGINS_ENV}) or rename a section"
                    )
                declared[section] = SettingsDeclaration(section, cls, impl.plugin_name)
        return declared

    @property
    def settings(self) -> PluginSettings:
        """The plugins' settings (section -> typed instance): the configured values over each class's
        defaults. Registry hooks and ``agl_on_startup`` receive it as their ``settings`` argument."""
        if self._settings is None:
            self._settings = build_settings(self.settings_declarations(), self._settings_section)
        return self._settings

    # -- registries ---------------------------------------------------------------------------

    def _registry(self, prop: str) -> Registry:
        if prop not in self._registries:
            hook_name, kind, config_key = REGISTRIES[prop]
            registry = Registry(kind, config_key)
            for impl in in_plugin_order(getattr(self._pm.hook, hook_name).get_hookimpls()):
                args = {
                    "register": lambda entry_name, obj, _p=impl.plugin_name: registry.add(entry_name, obj, _p),
                    "settings": self.settings if "settings" in impl.argnames else None,
                }
                try:
                    impl.function(*[args[name] for name in impl.argnames])
                except AglError:
                    raise
                except Exception as exc:  # a plugin's bug, not agl's: name the plugin
                    raise PluginError(
                        f"plugin {impl.plugin_name!r} failed in {hook_name}: {type(exc).__name__}: {exc}"
                    ) from exc
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

    def on_startup(self, config: Any) -> None:
        """Call every ``agl_on_startup`` with a copy of ``config`` whose secrets are redacted: no
        plugin ever sees the gateway key, whoever calls this."""
        self._call_each("agl_on_startup", "startup", config=redacted(config), settings=self.settings)

    def on_weights_served(self, endpoints: Sequence[str], version: int) -> None:
        """Call every ``agl_on_weights_served``: ``endpoints`` serve the weights of step ``version``."""
        self._call_each("agl_on_weights_served", f"weights {version}", endpoints=list(endpoints), version=version)

    def _call_each(self, hook_name: str, subject: str, **kwargs: Any) -> list[tuple[str, Any]]:
        impls = in_plugin_order(getattr(self._pm.hook, hook_name).get_hookimpls())
        return self.calls.call_each(impls, hook_name, subject, kwargs)

    def enqueue(self, request: RolloutRequest) -> RolloutRequest:
        """Pass ``request`` through every ``agl_on_enqueue`` in plugin order and return the result.

        A hook may not change a request's ids or its place in the batch (``FIXED_REQUEST_FIELDS``):
        such a change is undone, the rest of the result kept, and counted."""
        for impl in in_plugin_order(self._pm.hook.agl_on_enqueue.get_hookimpls()):
            subject = f"rollout {request.rollout_id}"
            ok, result = self.calls.call(impl, "agl_on_enqueue", subject, {"request": request})
            if not ok or result is None:
                continue
            if not isinstance(result, RolloutRequest):
                error = TypeError(f"agl_on_enqueue must return a RolloutRequest or None, got {type(result).__name__}")
                self.calls.record_failure("agl_on_enqueue", impl.plugin_name, subject, error)
                continue
            changed = [f for f in FIXED_REQUEST_FIELDS if getattr(result, f) != getattr(request, f)]
            if changed:
                self.calls.record_ignored_changes("agl_on_enqueue", impl.plugin_name, subject, changed)
                result = attrs.evolve(result, **{f: getattr(request, f) for f in changed})
            request = result
        return request

    def on_succeeded(
        self, rollout: CompletedRollout, events: dict[str, list[dict[str, Any]]], writer: EventWriter
    ) -> None:
        self._call_each(
            "agl_on_succeeded", f"rollout {rollout.rollout_id}", rollout=rollout, events=events, writer=writer
        )

    def on_failed(self, rollout: CompletedRollout, writer: EventWriter) -> None:
        self._call_each("agl_on_failed", f"rollout {rollout.rollout_id}", rollout=rollout, writer=writer)

    def pop_metrics(self) -> dict[str, float]:
        """The lifecycle hooks' failure, timeout and skip counts since the last call (see
        :class:`~agl_core.plugins.calls.HookCalls`)."""
        return self.calls.pop_metrics()

    # -- introspection ------------------------------------------------------------------------

    def list_plugins(self) -> list[PluginInfo]:
        """Every registered plugin with its source, the hooks it implements and the names it provides."""
        provides: dict[str, dict[str, list[str]]] = {}
        for prop in REGISTRIES:
            for entry in self._registry(prop).entries():
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
        return infos + self.broken()


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
