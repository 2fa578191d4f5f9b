"""Agent Lightning v1.0's example configs under agl: its examples' ``verl_default_config()`` dicts
(recorded in ``tests/fixtures/al_v1_configs/``: calc_x, gsm8k, search_r1, science_world, swe_smith)
load under ``backend=verl``; keys verl moved are named with their new place, and a verl-only key under
the torch backend says to run with ``backend=verl``."""

from __future__ import annotations

import json

import pytest
from omegaconf import DictConfig, OmegaConf

from agl_backend_verl.config import load_verl_config, load_verl_config_mapping, verl_base
from agl_backend_verl.moved_keys import MOVED, REMOVED
from agl_core.config import ConfigError, default_config
from agl_core.runs.run_config import resolve_config
from tests.helpers.paths import FIXTURES

pytestmark = pytest.mark.verl

AL_V1_CONFIGS = FIXTURES / "al_v1_configs"
EXAMPLES = sorted(p.stem for p in AL_V1_CONFIGS.glob("*.json"))


def test_every_example_is_recorded():
    assert EXAMPLES == ["calc_x", "gsm8k", "science_world", "search_r1", "swe_smith"]


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e != "swe_smith"])
def test_v1_example_configs_load_under_backend_verl(example):
    path = AL_V1_CONFIGS / f"{example}.json"
    cfg = load_verl_config(path)
    recorded = json.loads(path.read_text())
    assert cfg.actor_rollout_ref.model.path == recorded["actor_rollout_ref"]["model"]["path"]
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.agentlightning.backend == "verl"


def test_swe_smiths_nccl_timeout_is_named_with_where_verl_09_reads_it(tmp_path):
    path = AL_V1_CONFIGS / "swe_smith.json"
    with pytest.raises(ConfigError) as info:
        load_verl_config(path)
    assert info.value.key == "trainer.nccl_timeout"
    assert info.value.message == (
        f"unknown key (in {path}); moved to actor_rollout_ref.nccl_timeout (where verl reads the process-group "
        "timeout): set it there"
    )
    moved = json.loads(path.read_text())
    moved["actor_rollout_ref"]["nccl_timeout"] = moved["trainer"].pop("nccl_timeout")
    fixed = tmp_path / "swe_smith.json"
    fixed.write_text(json.dumps(moved))
    # the next problem is the example's own: verl's dynamic batching needs every row within the token budget
    with pytest.raises(ConfigError, match="is 8192, less than the longest row") as info:
        load_verl_config(fixed)
    assert info.value.key == "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    assert (
        load_verl_config(
            fixed, ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=131072"]
        ).actor_rollout_ref.nccl_timeout
        == 1800
    )


def test_the_moved_and_removed_tables_match_verl_09():
    """Every old key is unknown to verl 0.9 (else the entry is stale) and every new place exists."""
    base = verl_base()
    for old in [*MOVED, *REMOVED]:
        assert OmegaConf.select(base, old, default="absent") == "absent", old
    for new, _ in MOVED.values():
        assert OmegaConf.select(base, new, default="absent") != "absent", new


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("critic.model.fsdp_config.param_offload=true", "moved to critic.fsdp (in verl 0.8): set it there"),
        ("actor_rollout_ref.rollout.skip_rollout=true", "moved to skip.rollout.enable (in verl 0.8, then 0.9)"),
        ("actor_rollout_ref.rollout.skip.enable=true", "moved to skip.rollout (in verl 0.9)"),
        ("data.sampler.class_path=pkg.Sampler", "a key of verl 0.7, which verl 0.9 removed without a replacement"),
        ("actor_rollout_ref.actor.router_replay.mode=R2", "a key of verl 0.8, which verl 0.9 removed"),
    ],
)
def test_keys_of_verl_07_and_08_say_where_they_went(override, message):
    with pytest.raises(ConfigError, match="unknown key") as info:
        load_verl_config(None, [override])
    assert message in info.value.message


@pytest.mark.parametrize("example", EXAMPLES)
def test_v1_example_configs_under_the_torch_backend_say_to_run_with_backend_verl(example):
    path = AL_V1_CONFIGS / f"{example}.json"
    with pytest.raises(ConfigError) as info:
        resolve_config(str(path), [])
    # the first key the core schema lacks (algorithm.use_kl_in_reward is a core key: its false passes)
    assert info.value.key != "algorithm.use_kl_in_reward"
    assert info.value.message.endswith("it is a key of backend 'verl': run with backend=verl")


def _first_verl_only_key_per_section() -> list[str]:
    """For each top-level section, the first key of verl's config the core schema lacks."""
    core, base, seen = default_config(), verl_base(), {}
    for key in _leaves(base):
        parent, _, name = key.rpartition(".")
        node = OmegaConf.select(core, parent) if parent else core
        if isinstance(node, DictConfig) and name not in node:
            seen.setdefault(key.split(".")[0], key)
    return sorted(seen.values())


def _leaves(node: DictConfig, prefix: str = ""):
    for key in node.keys():
        yield prefix + str(key)
        if not OmegaConf.is_interpolation(node, key) and isinstance(node.get(key), DictConfig):
            yield from _leaves(node[key], f"{prefix}{key}.")


@pytest.mark.slow
def test_a_verl_only_key_under_torch_gets_the_hint_even_when_the_config_has_other_verl_problems():
    keys = _first_verl_only_key_per_section()
    assert {"algorithm", "actor_rollout_ref", "critic", "reward", "trainer"} <= {k.split(".")[0] for k in keys}
    for key in keys:
        # trainer.nccl_timeout is refused under verl too: the hint must not depend on the rest loading there
        overrides = [f"{key}=null", "trainer.nccl_timeout=1800"]
        with pytest.raises(ConfigError) as info:
            resolve_config(None, overrides)
        assert info.value.key == key
        assert info.value.message.endswith("it is a key of backend 'verl': run with backend=verl"), info.value.message


def test_a_moved_key_under_torch_gets_where_it_went_and_the_hint():
    with pytest.raises(ConfigError) as info:
        resolve_config(None, ["trainer.nccl_timeout=1800"])
    assert info.value.message == (
        "unknown key (in overrides); moved to actor_rollout_ref.nccl_timeout (where verl reads the process-group "
        "timeout): set it there, under backend 'verl': run with backend=verl"
    )


# -- configs held in memory (agentlightning.verl.entrypoint.run_ppo's argument) ---------------------

# A v1.0 script's verl config, composed with Hydra over verl's ppo_trainer as v1.0's config is.
V1_HYDRA_CONFIG = """\
hydra:
  searchpath:
    - pkg://verl/trainer/config
defaults:
  - ppo_trainer
  - _self_
algorithm:
  adv_estimator: grpo
  enable_rollout_level_advantage: true
agentlightning:
  agl_base_url: http://localhost:8080
  trace_aggregator:
    level: trajectory
actor_rollout_ref:
  actor:
    policy_loss:
      loss_mode: per_rollout_mean
"""


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e != "swe_smith"])
@pytest.mark.parametrize("as_dictconfig", [False, True], ids=["dict", "DictConfig"])
def test_a_v1_scripts_config_in_memory_loads_with_agls_own_keys_filled(example, as_dictconfig):
    recorded = json.loads((AL_V1_CONFIGS / f"{example}.json").read_text())
    given = OmegaConf.create(recorded) if as_dictconfig else recorded
    cfg = load_verl_config_mapping(given)
    assert cfg == load_verl_config(AL_V1_CONFIGS / f"{example}.json")
    # the key whose absence stopped v1.0's run_ppo inside Ray ("Missing key replay")
    assert cfg.agentlightning.replay is None and cfg.agentlightning.backend == "verl"
    assert given == (OmegaConf.create(recorded) if as_dictconfig else recorded)  # the caller's object is unchanged


def test_a_v1_scripts_hydra_composed_config_loads(tmp_path):
    from hydra import compose, initialize_config_dir

    (tmp_path / "v1.yaml").write_text(V1_HYDRA_CONFIG)
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        composed = compose("v1", overrides=["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct"])
    assert composed.model_engine == "dp"  # Hydra's engine choice, which the flattened defaults leave out
    cfg = load_verl_config_mapping(
        composed, ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    )
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.data.train_batch_size == 8
    assert cfg.agentlightning.replay is None and cfg.agentlightning.gateway.max_retries == 5


@pytest.mark.parametrize(
    ("change", "key", "message"),
    [
        ({"agentlightning": {"replay_dir": "x"}}, "agentlightning.replay_dir", "did you mean 'replay'?"),
        ({"trainer": {"nccl_timeout": 60}}, "trainer.nccl_timeout", "moved to actor_rollout_ref.nccl_timeout"),
        ({"model_engine": "megatron"}, "model_engine", "composed with model_engine 'dp'"),
        ({"data": {"train_batch_size": "eight"}}, "data.train_batch_size", "got str 'eight'"),
    ],
)
def test_a_bad_key_in_memory_is_refused_by_name(change, key, message):
    recorded = json.loads((AL_V1_CONFIGS / "gsm8k.json").read_text())
    with pytest.raises(ConfigError) as info:
        load_verl_config_mapping(OmegaConf.merge(recorded, change))
    assert info.value.key == key and message in info.value.message
