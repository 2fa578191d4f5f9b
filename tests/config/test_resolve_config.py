"""``agl train`` and ``agl check`` read the config file once, the backend hint included."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from agl_core.config import ConfigError, ConfigFile, load_config, read_config_file
from agl_core.runs.run_config import resolve_config


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  total_training_steps: 2\nactor_rollout_ref:\n  rollout:\n    name: vllm\n")
    return path


def count_loads(monkeypatch) -> list[str]:
    loads: list[str] = []
    real = OmegaConf.load

    def load(path):
        loads.append(str(path))
        return real(path)

    monkeypatch.setattr(OmegaConf, "load", load)
    return loads


def test_the_file_is_read_once_even_when_the_backend_hint_tries_every_backend(config_file, monkeypatch):
    monkeypatch.setenv("AGL_DISABLE_PLUGIN_AUTOLOAD", "1")
    loads = count_loads(monkeypatch)
    with pytest.raises(ConfigError, match="it is a key of backend 'verl'"):
        resolve_config(str(config_file))
    assert loads.count(str(config_file)) == 1


def test_a_loader_takes_the_file_already_read_as_it_takes_its_path(config_file):
    config_file.write_text("trainer:\n  total_training_steps: 2\n")
    source = read_config_file(config_file)
    assert isinstance(source, ConfigFile)
    assert load_config(source) == load_config(str(config_file))
    assert source.content == OmegaConf.load(config_file)  # merging left it unchanged


def test_a_missing_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        resolve_config(str(tmp_path / "nope.yaml"))
