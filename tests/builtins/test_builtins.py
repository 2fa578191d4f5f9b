"""The built-ins live in agl_core/builtins/, one module per registry, and their old paths still import."""

from __future__ import annotations

import importlib
import sys

import pytest

from agl_core.plugins import DEFAULT_PLUGINS, PluginManager


def test_every_builtin_plugin_is_a_module_of_agl_core_builtins():
    assert all(module.startswith("agl_core.builtins.") for module in DEFAULT_PLUGINS.values())
    info = {i.name: i for i in PluginManager(load_entrypoints=False).list_plugins()}
    assert info["aggregators"].provides["aggregators"] == ("trajectory", "transition")
    assert info["torch"].provides["backends"] == ("torch",)
    assert set(info["sinks"].provides["metric_sinks"]) == {"jsonl", "console", "tensorboard", "wandb"}


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("agl_core.stages.levels", "agl_core.builtins.aggregators", "trajectory"),
        ("agl_core.stages.estimators", "agl_core.builtins.estimators", "grpo"),
        ("agl_core.stages.losses", "agl_core.builtins.losses", "token_mean"),
        ("agl_core.tracking.builtins", "agl_core.builtins.sinks", "agl_register_metric_sinks"),
    ],
)
def test_an_old_builtin_path_imports_with_a_deprecation_warning(old, new, name):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new):
        module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} has moved"):
        assert getattr(module, name) is getattr(importlib.import_module(new), name)
