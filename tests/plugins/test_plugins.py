"""Plugin discovery (entry points of real distributions), registries, blocking and introspection."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

from agl_core import hookimpl
from agl_core.plugins import BLOCKED_PLUGINS_ENV, DISABLE_AUTOLOAD_ENV, PluginError, PluginManager
from agl_core.plugins.registry import RegistryError

PLUGIN_MODULE = """
from agl_core import hookimpl


def shout_aggregate(rollouts, settings):
    return "shouted"


def half_loss(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    return 0.5, {}


@hookimpl
def agl_register_aggregators(register):
    register("shout", shout_aggregate)


@hookimpl
def agl_register_policy_losses(register):
    register("half", half_loss)


@hookimpl
def agl_register_advantage_estimators(register):
    register("constant", lambda rows, settings: [1.0 for _ in rows])


class EchoBackend:
    def __init__(self, config, plugins):
        self.config = config

    def fit(self):
        return self.config


@hookimpl
def agl_register_backends(register):
    register("echo", EchoBackend)
"""


@pytest.fixture(scope="module")
def installed_distribution(tmp_path_factory):
    """Build and pip-install a tiny third-party distribution with an ``agl`` entry point into a
    private target directory, then put that directory on ``sys.path`` (as site-packages would be)."""
    root = tmp_path_factory.mktemp("dist")
    src = root / "src"
    (src / "agl_shout").mkdir(parents=True)
    (src / "agl_shout" / "__init__.py").write_text(PLUGIN_MODULE)
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = ["setuptools>=68"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "agl-shout"
            version = "1.2.3"

            [project.entry-points.agl]
            shout = "agl_shout"

            [tool.setuptools]
            packages = ["agl_shout"]
            """
        )
    )
    target = root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
    )
    sys.path.insert(0, str(target))
    yield "shout"
    sys.path.remove(str(target))
    sys.modules.pop("agl_shout", None)


def test_installed_distribution_is_discovered_and_usable(installed_distribution, monkeypatch):
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    monkeypatch.delenv(BLOCKED_PLUGINS_ENV, raising=False)
    manager = PluginManager()
    assert manager.get_plugin("shout") is not None
    assert manager.aggregators.get("shout")([], None) == "shouted"
    assert manager.aggregators.entry("shout").plugin_name == "shout"
    assert manager.policy_losses.get("half")(None, None, None, None, None)[0] == 0.5
    assert manager.advantage_estimators.get("constant")(["row"], None) == [1.0]
    assert manager.backends.get("echo")({"k": 1}, manager).fit() == {"k": 1}
    info = {i.name: i for i in manager.list_plugins()}["shout"]
    assert info.source == "entry point (agl-shout 1.2.3)"
    assert info.hooks == (
        "agl_register_advantage_estimators",
        "agl_register_aggregators",
        "agl_register_backends",
        "agl_register_policy_losses",
    )
    assert info.provides == {
        "aggregators": ("shout",),
        "advantage_estimators": ("constant",),
        "policy_losses": ("half",),
        "backends": ("echo",),
    }


def test_blocking_by_env_removes_the_plugin(installed_distribution, monkeypatch):
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    monkeypatch.setenv(BLOCKED_PLUGINS_ENV, "other, shout")
    manager = PluginManager()
    assert manager.get_plugin("shout") is None
    assert "shout" not in manager.aggregators


def test_autoload_can_be_disabled_by_env(installed_distribution, monkeypatch):
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    assert PluginManager().get_plugin("shout") is None


class _Registers:
    def __init__(self, name):
        self.name = name

    @hookimpl
    def agl_register_aggregators(self, register):
        register(self.name, lambda rollouts, settings: None)


def test_duplicate_registry_names_name_both_plugins():
    manager = PluginManager(load_entrypoints=False, builtins={})
    manager.register(_Registers("same"), name="first-plugin")
    manager.register(_Registers("same"), name="second-plugin")
    with pytest.raises(
        RegistryError, match="'same' is registered by both plugin 'first-plugin' and plugin 'second-plugin'"
    ):
        _ = manager.aggregators


class _FailsToRegister:
    @hookimpl
    def agl_register_aggregators(self, register):
        raise RuntimeError("boom")


def test_a_failing_registry_hook_names_its_plugin():
    manager = PluginManager(load_entrypoints=False, builtins={})
    manager.register(_FailsToRegister(), name="broken-plugin")
    with pytest.raises(
        PluginError, match="plugin 'broken-plugin' failed in agl_register_aggregators: RuntimeError: boom"
    ):
        _ = manager.aggregators


def test_unknown_name_lists_what_is_registered():
    manager = PluginManager(load_entrypoints=False, builtins={})
    manager.register(_Registers("alpha"), name="p")
    with pytest.raises(
        RegistryError,
        match=r"unknown aggregator 'beta' \(set by agentlightning.trace_aggregator.level\); registered: alpha",
    ):
        manager.aggregators.get("beta")


def test_registries_are_rebuilt_after_a_late_registration():
    manager = PluginManager(load_entrypoints=False, builtins={})
    assert "late" not in manager.aggregators
    manager.register(_Registers("late"), name="late-plugin")
    assert "late" in manager.aggregators


def test_misspelt_hook_fails_loudly():
    class Typo:
        @hookimpl
        def agl_register_agregators(self, register):
            pass

    manager = PluginManager(load_entrypoints=False, builtins={})
    with pytest.raises(
        PluginError, match="unknown hook 'agl_register_agregators'; did you mean 'agl_register_aggregators'"
    ):
        manager.register(Typo(), name="typo")


def test_hookimpl_with_wrong_arguments_is_refused():
    class WrongArgs:
        @hookimpl
        def agl_on_enqueue(self, request, extra):
            return None

    manager = PluginManager(load_entrypoints=False, builtins={})
    with pytest.raises(PluginError, match="does not fit the hookspecs"):
        manager.register(WrongArgs(), name="wrong")


def test_tryfirst_runs_before_registration_order():
    order = []

    class Plain:
        @hookimpl
        def agl_on_startup(self):
            order.append("plain")

    class Early:
        @hookimpl(tryfirst=True)
        def agl_on_startup(self):
            order.append("early")

    manager = PluginManager(load_entrypoints=False, builtins={})
    manager.register(Plain(), name="plain")
    manager.register(Early(), name="early")
    manager.on_startup(config={})
    assert order == ["early", "plain"]


def test_builtins_are_ordinary_blockable_plugins(monkeypatch):
    monkeypatch.setenv(BLOCKED_PLUGINS_ENV, "tests.plugins.test_plugins")
    manager = PluginManager(
        load_entrypoints=False, builtins={"tests.plugins.test_plugins": "tests.plugins.test_plugins"}
    )
    assert manager.get_plugin("tests.plugins.test_plugins") is None
    monkeypatch.delenv(BLOCKED_PLUGINS_ENV)
    manager = PluginManager(
        load_entrypoints=False, builtins={"tests.plugins.test_plugins": "tests.plugins.test_plugins"}
    )
    assert {i.name: i.source for i in manager.list_plugins()}["tests.plugins.test_plugins"] == "built-in"


def test_a_registry_is_a_read_only_mapping_of_names():
    from collections.abc import Mapping

    import pytest

    from agl_core.plugins import PluginManager, RegistryError

    aggregators = PluginManager(load_entrypoints=False).aggregators
    assert isinstance(aggregators, Mapping)
    assert list(aggregators) == aggregators.names() and "trajectory" in aggregators
    assert aggregators["trajectory"] is aggregators.get("trajectory") is dict(aggregators.items())["trajectory"]
    assert aggregators.get("nope", None) is None
    with pytest.raises(RegistryError, match="unknown aggregator 'trajectry' .*did you mean 'trajectory'"):
        aggregators["trajectry"]
    with pytest.raises(RegistryError, match="set by agentlightning.trace_aggregator.level"):
        aggregators.get("trajectry")
    assert [e.name for e in aggregators.entries()] == aggregators.names() and aggregators.entry(
        "trajectory"
    ).plugin_name == "aggregators"
    with pytest.raises(TypeError):
        aggregators["mine"] = lambda rollouts, settings: None  # noqa: ARG005


def test_an_object_registered_without_a_name_is_named_by_its_class():
    """Hook failures and listings name a plugin given in code by its class, not by pluggy's id string."""

    class Counter:
        @hookimpl
        def agl_on_enqueue(self, request):
            return None

    manager = PluginManager(load_entrypoints=False, builtins={})
    first, second = manager.register(Counter()), manager.register(Counter())
    base = f"{__name__}.test_an_object_registered_without_a_name_is_named_by_its_class.<locals>.Counter"
    assert (first, second) == (base, base + "#2")
    assert manager.register(types.ModuleType("shout_plugin")) == "shout_plugin"  # a module keeps its name
