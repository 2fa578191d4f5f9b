"""The built-ins live in agl_core/builtins/, one module per registry."""

from __future__ import annotations

from agl_core.plugins import DEFAULT_PLUGINS, PluginManager


def test_every_builtin_plugin_is_a_module_of_agl_core_builtins():
    assert all(module.startswith("agl_core.builtins.") for module in DEFAULT_PLUGINS.values())
    info = {i.name: i for i in PluginManager(load_entrypoints=False).list_plugins()}
    assert info["aggregators"].provides["aggregators"] == ("trajectory", "transition")
    assert info["torch"].provides["backends"] == ("torch",)
    assert set(info["sinks"].provides["metric_sinks"]) == {"jsonl", "console", "tensorboard", "wandb"}
