"""Configs as users write them load, or fail with an error naming the key: Hydra-style verl configs,
verl keys under the torch backend, interpolations, shapes, override typos, lists of dataset files."""

from __future__ import annotations

import json
import textwrap

import pytest

from agl_core.config import ConfigError, load_config
from agl_core.files.datasets import load_dataset
from agl_core.plugins import DISABLE_AUTOLOAD_ENV
from agl_core.runs.run_config import resolve_config

# A verl run config as Hydra reads it (the shape of Agent Lightning v1.0's verl config): it composes
# verl's ppo_trainer under itself and tells Hydra where verl's configs are.
HYDRA_VERL_CONFIG = """
hydra:
  searchpath:
    - pkg://verl/trainer/config
defaults:
  - ppo_trainer
  - _self_
algorithm:
  enable_rollout_level_advantage: true
agentlightning:
  agl_base_url: http://localhost:8080
  hooks: null
  trace_aggregator:
    level: trajectory
data:
  filter_overlong_prompts: false
actor_rollout_ref:
  actor:
    calculate_entropy: true
  rollout:
    mode: async
"""


@pytest.fixture
def no_autoload(monkeypatch):
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")


def write(tmp_path, text, name="config.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.verl
def test_a_hydra_verl_config_loads_under_backend_verl(tmp_path, no_autoload):
    pytest.importorskip("verl")
    path = write(tmp_path, HYDRA_VERL_CONFIG)
    config, _ = resolve_config(str(path), ["agentlightning.backend=verl"])
    assert config.actor_rollout_ref.rollout.mode == "async"
    assert config.critic.ppo_epochs == 1, "verl's ppo_trainer is the base, as the defaults list asks"
    assert "defaults" not in config and "hydra" not in config


def test_a_hydra_verl_config_under_the_torch_backend_says_to_use_verl(tmp_path, no_autoload):
    with pytest.raises(ConfigError, match="run with backend=verl") as info:
        resolve_config(str(write(tmp_path, HYDRA_VERL_CONFIG)), [])
    assert info.value.key == "defaults"
    hydra_only = write(tmp_path, "hydra:\n  searchpath: [pkg://verl/trainer/config]\n", "hydra.yaml")
    with pytest.raises(ConfigError, match="run with backend=verl") as info:
        load_config(hydra_only)
    assert info.value.key == "hydra"


@pytest.mark.verl
@pytest.mark.parametrize(
    "text, key, message",
    [
        ("defaults:\n  - _self_\n  - ppo_trainer\n", "defaults", "_self_ must come last"),
        (
            "defaults:\n  - ppo_trainer\n  - override actor@actor_rollout_ref.actor: megatron_actor\n",
            "defaults",
            "is not composed by agl",
        ),
        ("hydra:\n  run:\n    dir: outputs\n", "hydra.run", "only hydra.searchpath"),
    ],
)
def test_what_agl_cannot_compose_is_named(tmp_path, text, key, message):
    verl_config = pytest.importorskip("agl_backend_verl.config")
    with pytest.raises(ConfigError, match=message) as info:
        verl_config.load_verl_config(write(tmp_path, text))
    assert info.value.key == key


@pytest.mark.verl
def test_a_verl_key_under_the_torch_backend_says_to_use_verl(tmp_path, no_autoload):
    pytest.importorskip("verl")
    path = write(tmp_path, "actor_rollout_ref:\n  rollout:\n    name: vllm\n    gpu_memory_utilization: 0.3\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(str(path), [])
    assert info.value.key == "actor_rollout_ref.rollout.name"
    assert str(info.value).endswith(f"unknown key (in {path}); it is a key of backend 'verl': run with backend=verl")
    with pytest.raises(ConfigError) as typo:
        resolve_config(None, ["trainer.total_epoch=3"])
    assert str(typo.value) == "config key trainer.total_epoch: unknown key (in overrides); did you mean 'total_epochs'?"


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        (
            ["agentlightning.agl_key=${oc.env:AGL_TEST_UNSET_VARIABLE}"],
            "agentlightning.agl_key",
            "environment variable 'AGL_TEST_UNSET_VARIABLE' is not set",
        ),
        (
            ["trainer.experiment_name=${oc.env:AGL_TEST_UNSET_VARIABLE}"],
            "trainer.experiment_name",
            "Environment variable 'AGL_TEST_UNSET_VARIABLE' not found",
        ),
        (["trainer.project_name=${trainer.nope}"], "trainer.project_name", "its interpolation cannot be resolved"),
        (
            ["agentlightning.local.env_map=[a]"],
            "agentlightning.local.env_map",
            "must be a mapping (key: value), got a list ['a']",
        ),
        (
            ["actor_rollout_ref.actor.optim=0.1"],
            "actor_rollout_ref.actor.optim",
            "must be a mapping (key: value), got a single value",
        ),
        (["=1"], "<override>", "'=1' names no key"),
        (["trainer..seed=1"], "trainer..seed", "not a key path (an empty part between dots"),
        (
            ["trainer.total_training_steps="],
            "trainer.total_training_steps",
            "has no value: write trainer.total_training_steps=null",
        ),
    ],
)
def test_errors_omegaconf_reports_without_a_key_name_it(monkeypatch, overrides, key, message):
    monkeypatch.delenv("AGL_TEST_UNSET_VARIABLE", raising=False)
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert info.value.key == key
    assert message in str(info.value)


def test_an_interpolation_in_a_file_is_named_too(tmp_path, monkeypatch):
    monkeypatch.delenv("AGL_TEST_UNSET_VARIABLE", raising=False)
    path = write(tmp_path, "agentlightning:\n  agl_key: ${oc.env:AGL_TEST_UNSET_VARIABLE}\n")
    with pytest.raises(ConfigError, match="environment variable 'AGL_TEST_UNSET_VARIABLE' is not set") as info:
        load_config(path)
    assert info.value.key == "agentlightning.agl_key"
    monkeypatch.setenv("AGL_TEST_UNSET_VARIABLE", "k")
    assert load_config(path).agentlightning.agl_key == "k"


def test_a_list_of_dataset_files_is_their_rows_in_order(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps({"x": 1}) + "\n")
    second.write_text(json.dumps({"x": 2}) + "\n" + json.dumps({"x": 3}) + "\n")
    cfg = load_config(overrides=[f"data.train_files=[{first},{second}]"])
    assert [row["x"] for row in load_dataset(cfg.data.train_files)] == [1, 2, 3]
    with pytest.raises(ConfigError, match=f"dataset file not found: {tmp_path / 'c.jsonl'}") as info:
        load_dataset([str(first), str(tmp_path / "c.jsonl")], "data.val_files")
    assert info.value.key == "data.val_files"
    with pytest.raises(ConfigError, match="no dataset file given"):
        load_dataset([])


def test_a_bad_row_in_a_list_of_dataset_files_names_its_file(tmp_path):
    from agl_core.files.datasets import check_datasets

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps({"signs": [1]}) + "\n")
    second.write_text(json.dumps({"signs": [2]}) + "\n" + json.dumps({"sign": [3]}) + "\n")
    cfg = load_config(
        overrides=[f"data.train_files=[{first},{second}]", "agentlightning.local.env_map={SIGNS: input.signs}"]
    )
    with pytest.raises(ConfigError, match=f"row 2 of 2 of {second}: agentlightning.local.env_map.SIGNS") as info:
        check_datasets(cfg)
    assert info.value.key == "data.train_files"
    second.write_text(json.dumps({"signs": [2]}) + "\n")
    assert check_datasets(cfg)["data.train_files"] == 2
