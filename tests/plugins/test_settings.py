"""Plugin settings: declared through ``agl_plugin_settings``, set under ``agentlightning.plugins``,
validated with errors naming the full key, received typed by the plugin's hooks."""

from __future__ import annotations

import dataclasses

import attrs
import pytest

from agl_core import hookimpl
from agl_core.config import ConfigError
from agl_core.plugins import PluginError, PluginManager


@dataclasses.dataclass
class WindowSettings:
    window_k: int = 3
    tag: str = "window"

    def __post_init__(self):
        if self.window_k < 1:
            raise ValueError(f"'window_k' must be at least 1, got {self.window_k}")


@attrs.frozen
class PenaltySettings:
    coef: float = attrs.field(default=0.1, validator=attrs.validators.ge(0.0))


class Windowed:
    """Declares two sections and reads them in a registry hook and in agl_on_startup."""

    def __init__(self):
        self.started_with = None

    @hookimpl
    def agl_plugin_settings(self):
        return {"windowed": WindowSettings, "penalty": PenaltySettings}

    @hookimpl
    def agl_register_aggregators(self, register, settings):
        window = settings["windowed"]
        register("windowed", lambda rollouts, agg_settings: window)

    @hookimpl
    def agl_on_startup(self, config, settings):
        self.started_with = settings["penalty"]


def manager(plugins_section=None, *plugins):
    config = {"agentlightning": {"plugins": plugins_section}} if plugins_section is not None else {}
    return PluginManager.from_config(config, plugins or (Windowed(),), load_entrypoints=False)


def test_defaults_when_the_config_sets_nothing():
    settings = manager().settings
    assert settings["windowed"] == WindowSettings() and settings["penalty"] == PenaltySettings()


def test_values_from_the_config_reach_the_hooks_typed():
    plugin = Windowed()
    m = manager({"windowed": {"window_k": "5"}, "penalty": {"coef": 0.5}}, plugin)
    assert m.aggregators.get("windowed")([], None) == WindowSettings(window_k=5)
    m.on_startup({})
    assert plugin.started_with == PenaltySettings(coef=0.5)


def test_configure_rebuilds_the_registries_with_the_new_settings():
    m = manager()
    assert m.aggregators.get("windowed")([], None).window_k == 3
    m.configure({"agentlightning": {"plugins": {"windowed": {"window_k": 7}}}})
    assert m.aggregators.get("windowed")([], None).window_k == 7


@pytest.mark.parametrize(
    "section, key, message",
    [
        (
            {"windowed": {"window_k": "many"}},
            "agentlightning.plugins.windowed.window_k",
            "could not be converted to Integer",
        ),
        (
            {"windowed": {"window_k": 0}},
            "agentlightning.plugins.windowed.window_k",
            "'window_k' must be at least 1, got 0",
        ),
        ({"penalty": {"coef": -1.0}}, "agentlightning.plugins.penalty.coef", "'coef' must be >= 0.0: -1.0"),
        ({"windowed": {"window": 2}}, "agentlightning.plugins.windowed.window", "unknown setting of plugin"),
        (
            {"windowd": {"window_k": 2}},
            "agentlightning.plugins.windowd",
            "no plugin declares these settings; did you mean 'windowed'?",
        ),
        ({"windowed": 3}, "agentlightning.plugins.windowed", "must be a mapping of settings"),
    ],
)
def test_a_wrong_setting_is_an_error_naming_its_full_key(section, key, message):
    with pytest.raises(ConfigError) as err:
        manager(section)
    assert err.value.key == key and message in str(err.value)


def test_an_unknown_setting_suggests_the_field():
    with pytest.raises(ConfigError, match="did you mean 'window_k'"):
        manager({"windowed": {"window": 2}})


class NoDefault:
    @dataclasses.dataclass
    class Settings:
        needed: int

    @hookimpl
    def agl_plugin_settings(self):
        return {"nodefault": self.Settings}


class NotAClass:
    @hookimpl
    def agl_plugin_settings(self):
        return {"plain": dict}


class SameSection:
    @hookimpl
    def agl_plugin_settings(self):
        return {"windowed": PenaltySettings}


@pytest.mark.parametrize(
    "plugins, message",
    [
        ((NoDefault(),), "field(s) needed have no default"),
        ((NotAClass(),), "neither a dataclass nor an attrs class"),
        ((Windowed(), SameSection()), "settings 'windowed' are declared by both plugin"),
    ],
)
def test_a_bad_declaration_names_the_plugin(plugins, message):
    with pytest.raises(PluginError, match="plugin") as err:
        PluginManager.from_config({}, plugins, load_entrypoints=False)
    assert message in str(err.value)


def test_agl_check_refuses_a_wrong_setting_naming_the_key(tmp_path, capsys, monkeypatch):
    """Through the command line, with the settings declared by a hook file."""
    from agl_core.cli import main

    monkeypatch.setenv("AGL_DISABLE_PLUGIN_AUTOLOAD", "1")
    hooks = tmp_path / "hooks.py"
    hooks.write_text(
        "import dataclasses\nfrom agl_core import hookimpl\n\n"
        "@dataclasses.dataclass\nclass Tagging:\n    tag: str = 'x'\n    every: int = 1\n\n"
        "@hookimpl\ndef agl_plugin_settings():\n    return {'tagging': Tagging}\n"
    )
    code = main(
        [
            "check",
            "examples/corridor/config.yaml",
            f"agentlightning.hooks={hooks}",
            "agentlightning.plugins.tagging.every=often",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(
        "agl: error: config key agentlightning.plugins.tagging.every: "
        "Value 'often' of type 'str' could not be converted to Integer"
    ), err


def test_train_resolves_the_settings_of_its_config(tmp_path, monkeypatch):
    from agl_core.runs.run_config import resolve_config

    monkeypatch.setenv("AGL_DISABLE_PLUGIN_AUTOLOAD", "1")
    _, m = resolve_config("examples/corridor/config.yaml", ["agentlightning.plugins.windowed.window_k=4"], [Windowed()])
    assert m.settings["windowed"] == WindowSettings(window_k=4)
    assert m.aggregators.get("windowed")([], None).window_k == 4
