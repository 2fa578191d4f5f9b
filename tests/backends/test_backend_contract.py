"""What ``agl_register_backends`` accepts: a BackendSpec (factory + config loader) or a bare factory."""

from __future__ import annotations

import json

import pytest

from agl_core import hookimpl
from agl_core.backends.contract import BackendSpec
from agl_core.config import load_config
from agl_core.plugins import RegistryError
from agl_core.runs.run_config import resolve_config
from agl_core.runs.train import run


class OneStep:
    """A backend that reports one step and the experiment name it was configured with."""

    def __init__(self, config, plugins):
        self.config = config

    def fit(self, on_step=None):
        on_step(1, 1, {"training/reward": 1.0 if self.config.trainer.experiment_name == "own" else 0.0})


def own_loader(path, overrides):
    """A backend's own loader: the core schema, with a value only this loader sets."""
    return load_config(path, [*overrides, "trainer.experiment_name=own"])


class Backends:
    @hookimpl
    def agl_register_backends(self, register):
        register("bare", OneStep)
        register("own", BackendSpec(OneStep, load_config=own_loader))


class Broken:
    @hookimpl
    def agl_register_backends(self, register):
        register("broken", 42)


def test_a_bare_factory_runs_are_validated_against_the_core_schema():
    config, manager = resolve_config(None, ["agentlightning.backend=bare"], [Backends()])
    assert config.trainer.experiment_name == "run"
    assert "bare" in manager.backends


def test_a_spec_validates_its_runs_with_its_own_loader_and_builds_with_its_factory(tmp_path):
    config, _ = resolve_config(None, ["agentlightning.backend=own"], [Backends()])
    assert config.trainer.experiment_name == "own"
    run_dir = run(
        None, ["agentlightning.backend=own", f"trainer.default_local_dir={tmp_path}"], [Backends()], show_progress=False
    )
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["training/reward"]) for line in lines] == [(1, 1.0)]


def test_a_registration_that_is_neither_names_the_backend():
    with pytest.raises(RegistryError, match=r"registered backend 'broken' as 42, which cannot be called"):
        resolve_config(None, ["agentlightning.backend=broken"], [Broken()])
