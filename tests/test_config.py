"""The config schema: defaults, merging, errors that name the key, and redaction of the gateway key."""

from __future__ import annotations

import pytest

from agl_core.config import ConfigError, load_config, redacted, to_yaml


def test_defaults_are_agent_lightning_v1(tmp_path):
    cfg = load_config()
    agl = cfg.agentlightning
    assert agl.rollout_timeout_seconds == 1800
    assert agl.trace_aggregator.level == "trajectory"
    assert (agl.trace_aggregator.trajectory_max_prompt_length, agl.trace_aggregator.trajectory_max_response_length) == (2048, 8192)
    assert agl.reward_fillna_value == 0.0 and agl.async_rollout.enabled is False
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "per_rollout_mean"
    assert cfg.algorithm.enable_rollout_level_advantage is True


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_batch_size: 8\nagentlightning:\n  hooks: [a.py, b.py]\n")
    cfg = load_config(path, ["data.train_batch_size=16", "actor_rollout_ref.rollout.n=4"])
    assert cfg.data.train_batch_size == 16 and cfg.actor_rollout_ref.rollout.n == 4
    assert list(cfg.agentlightning.hooks) == ["a.py", "b.py"]


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        (["agentlightning.nope=1"], "agentlightning.nope", "unknown key"),
        (["data.train_batch_size=many"], "data.train_batch_size", "could not be converted"),
        (["data.train_batch_size=0"], "data.train_batch_size", "positive integer"),
        (["agentlightning.async_rollout.enabled=true", "data.train_batch_size=8"], "agentlightning.async_rollout.async_train_batch_size", "greater than data.train_batch_size"),
        (["agentlightning.async_rollout.enabled=true", "data.train_batch_size=8", "agentlightning.async_rollout.async_train_batch_size=8"], "agentlightning.async_rollout.async_train_batch_size", "greater than"),
        (["agentlightning.agl_base_url=localhost:8080"], "agentlightning.agl_base_url", "http"),
        (["agentlightning.hooks={a: 1}"], "agentlightning.hooks", "path or a list"),
        (["agentlightning.vllm.python=''"], "agentlightning.vllm.python", "path of a python"),
        (["actor_rollout_ref.actor.clip_ratio_c=0.5"], "actor_rollout_ref.actor.clip_ratio_c", "greater than 1"),
        (["trainer.total_epochs"], "trainer.total_epochs", "key=value"),
    ],
)
def test_errors_name_the_key(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(overrides=overrides)
    assert info.value.key == key
    assert key in str(info.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("trainer:\n  total_epoch: 3\n")
    with pytest.raises(ConfigError, match=r"trainer.total_epoch: unknown key \(in .*unknown.yaml\)"):
        load_config(unknown)


def test_the_gateway_key_never_shows():
    secret = "sk-live-4242"
    cfg = load_config(overrides=[f"agentlightning.agl_key={secret}"])
    assert cfg.agentlightning.agl_key == secret
    assert secret not in to_yaml(cfg) and "***" in to_yaml(cfg)
    assert redacted(cfg).agentlightning.agl_key == "***"
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"agentlightning.agl_key=[{secret}]"])
    assert secret not in str(info.value)
