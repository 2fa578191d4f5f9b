"""``agl_on_startup`` runs exactly once per run, called by the backend (not by ``agl train`` on top),
always with the gateway key redacted."""

from __future__ import annotations

import pytest

from agl_core import hookimpl
from agl_core.config import REDACTED
from agl_core.plugins import DISABLE_AUTOLOAD_ENV, PluginManager
from agl_core.runs.train import run
from tests.helpers.corridor_policy import build_corridor_policy

CONFIG = "examples/corridor/config.yaml"
KEY = "sk-agl-startup-secret"


@pytest.fixture(autouse=True)
def own_plugins_only(monkeypatch):
    """Built-ins and agl's own entry points, whatever else the environment has installed."""
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")


class Startup:
    def __init__(self):
        self.keys: list[str] = []
        self.enqueued_before_startup = 0

    @hookimpl
    def agl_on_startup(self, config):
        self.keys.append(config.agentlightning.agl_key)

    @hookimpl
    def agl_on_enqueue(self, request):
        if not self.keys:
            self.enqueued_before_startup += 1


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_corridor_policy(tmp_path_factory.mktemp("policy"))


def test_the_torch_backend_starts_plugins_once_with_the_key_redacted(policy, tmp_path):
    plugin = Startup()
    overrides = [
        f"actor_rollout_ref.model.path={policy}",
        f"trainer.default_local_dir={tmp_path}",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"agentlightning.agl_key={KEY}",  # the embedded source's own gateway uses it
    ]
    run(CONFIG, overrides, plugins=[plugin], show_progress=False)
    assert plugin.keys == [REDACTED]
    assert plugin.enqueued_before_startup == 0


class Quiet:
    """A backend that trains nothing and calls no hook: ``agl train`` adds no startup call of its own."""

    def __init__(self, config, plugins):
        pass

    def fit(self, on_step=None):
        pass


class QuietBackend:
    @hookimpl
    def agl_register_backends(self, register):
        register("quiet", Quiet)


def test_agl_train_leaves_the_startup_call_to_the_backend(tmp_path):
    plugin = Startup()
    run(
        None,
        ["agentlightning.backend=quiet", f"trainer.default_local_dir={tmp_path}"],
        plugins=[QuietBackend(), plugin],
        show_progress=False,
    )
    assert plugin.keys == []


def test_the_manager_redacts_whatever_config_it_is_given():
    plugin = Startup()
    manager = PluginManager(load_entrypoints=False, builtins={})
    manager.register(plugin)
    manager.on_startup({"agentlightning": {"agl_key": KEY}})
    assert plugin.keys == [REDACTED]
