"""The config schema: defaults, merging, errors that name the key, and redaction of the gateway key."""

from __future__ import annotations

import re

import pytest

from agl_core.config import ConfigError, load_config, redacted, to_yaml


def test_defaults_are_agent_lightning_v1(tmp_path):
    cfg = load_config()
    agl = cfg.agentlightning
    assert agl.rollout_timeout_seconds == 1800
    assert agl.trace_aggregator.level == "trajectory"
    assert (agl.trace_aggregator.trajectory_max_prompt_length, agl.trace_aggregator.trajectory_max_response_length) == (
        2048,
        8192,
    )
    assert agl.reward_fillna_value == 0.0 and agl.async_rollout.enabled is False
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "per_rollout_mean"
    assert cfg.algorithm.enable_rollout_level_advantage is True


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_batch_size: 8\nagentlightning:\n  hooks: [a.py, b.py]\n")
    cfg = load_config(
        path,
        ["data.train_batch_size=16", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8"],
    )
    assert cfg.data.train_batch_size == 16 and cfg.actor_rollout_ref.rollout.n == 4
    assert list(cfg.agentlightning.hooks) == ["a.py", "b.py"]


MINI = "actor_rollout_ref.actor.ppo_mini_batch_size=8"


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        (["agentlightning.nope=1"], "agentlightning.nope", "unknown key"),
        (["data.train_batch_size=many"], "data.train_batch_size", "could not be converted"),
        (["data.train_batch_size=0"], "data.train_batch_size", "positive integer"),
        (
            ["agentlightning.async_rollout.enabled=true", "data.train_batch_size=8", MINI],
            "agentlightning.async_rollout.async_train_batch_size",
            "greater than data.train_batch_size",
        ),
        (
            [
                "agentlightning.async_rollout.enabled=true",
                "data.train_batch_size=8",
                MINI,
                "agentlightning.async_rollout.async_train_batch_size=8",
            ],
            "agentlightning.async_rollout.async_train_batch_size",
            "greater than",
        ),
        (["agentlightning.agl_base_url=localhost:8080"], "agentlightning.agl_base_url", "http"),
        (["agentlightning.hooks={a: 1}"], "agentlightning.hooks", "path or a list"),
        (["agentlightning.vllm.python=''"], "agentlightning.vllm.python", "path of a python"),
        (["agentlightning.vllm.url=localhost:8000"], "agentlightning.vllm.url", "http"),
        (["agentlightning.vllm.port=70000"], "agentlightning.vllm.port", "a port number"),
        (["agentlightning.torch.device=gpu"], "agentlightning.torch.device", "auto, cpu, cuda or cuda:N"),
        (["actor_rollout_ref.actor.optim.betas=[0.9]"], "actor_rollout_ref.actor.optim.betas", "two numbers"),
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
    for wrong_shape in (
        f"agentlightning.agl_key=[{secret}]",
        f"agentlightning.agl_key={{a: {secret}}}",
        f"agentlightning.agl_key.token={secret}",
    ):
        with pytest.raises(ConfigError) as info:
            load_config(overrides=[wrong_shape])
        assert secret not in str(info.value) and "agentlightning.agl_key" in str(info.value), wrong_shape


def test_the_gateway_key_never_shows_from_a_file(tmp_path):
    secret = "sk-file-999"
    path = tmp_path / "config.yaml"
    path.write_text(f"agentlightning:\n  agl_key:\n    token: {secret}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert secret not in str(info.value)


# Values that would not fail but train wrongly, or train nothing, each refused naming its key.
HARMFUL_VALUES = [
    ("actor_rollout_ref.actor.grad_clip=-1", "greater than 0"),
    ("actor_rollout_ref.actor.grad_clip=0", "greater than 0"),
    ("actor_rollout_ref.actor.clip_ratio=-0.2", "0 or more"),
    ("actor_rollout_ref.actor.clip_ratio_low=-0.1", "0 or more or null"),
    ("actor_rollout_ref.actor.clip_ratio_high=nan", "0 or more or null"),
    ("actor_rollout_ref.actor.clip_ratio_c=nan", "greater than 1.0"),
    ("actor_rollout_ref.actor.kl_loss_coef=-0.5", "0 or more"),
    ("actor_rollout_ref.actor.optim.lr=-1", "greater than 0"),
    ("actor_rollout_ref.actor.optim.lr=nan", "greater than 0"),
    ("actor_rollout_ref.actor.optim.lr=inf", "finite"),
    ("actor_rollout_ref.actor.optim.weight_decay=-0.01", "0 or more"),
    ("actor_rollout_ref.actor.optim.min_lr_ratio=2", "between 0 and 1"),
    ("actor_rollout_ref.actor.optim.betas=[0.9]", "two numbers"),
    ("actor_rollout_ref.actor.optim.betas=[0.9,1.5]", "two numbers"),
    ("actor_rollout_ref.rollout.top_p=0", "greater than 0 and at most 1"),
    ("actor_rollout_ref.rollout.top_p=2", "greater than 0 and at most 1"),
    ("actor_rollout_ref.rollout.temperature=-1", "0 (greedy)"),
    ("actor_rollout_ref.rollout.val_kwargs.temperature=nan", "0 (greedy)"),
    ("algorithm.gamma=-0.5", "between 0 and 1"),
    ("agentlightning.reward_fillna_value=nan", "finite"),
    ("agentlightning.reward_fillna_value=-inf", "finite"),
    ("trainer.total_training_steps=0", "positive integer or null"),
    ("trainer.total_training_steps=-5", "positive integer or null"),
    ("trainer.total_epochs=0", "positive integer"),
    ("actor_rollout_ref.actor.ppo_epochs=0", "positive integer"),
    ("data.max_prompt_length=0", "positive integer"),
    ("data.max_response_length=-1", "positive integer"),
    ("trainer.seed=-1", "0 or more"),
    ("data.seed=-3", "0 or more"),
    ("agentlightning.gateway.retry_backoff_seconds=nan", "0 or more"),
    ("agentlightning.verl.replica_bind_host=http://node7", "a host name or an IPv4 address"),
    ("agentlightning.verl.replica_bind_host=fd00::1", "a host name or an IPv4 address"),  # it listens on IPv4
    ("agentlightning.verl.replica_advertise_host=node7:8000", "a host name or an IP address (no scheme, no port)"),
    # a key typed bool takes true or false (YAML's yes/on/no/off spell them), never a number or a word
    ("agentlightning.torch.share_prefixes=2", "must be true or false, got 2 (in overrides)"),
    ("agentlightning.record_rollouts=maybe", "must be true or false, got 'maybe' (in overrides)"),
    ("algorithm.use_kl_in_reward=true", "put the KL term in the loss instead (actor_rollout_ref.actor.use_kl_loss"),
]


@pytest.mark.parametrize("override, message", HARMFUL_VALUES)
def test_harmful_values_are_refused_naming_the_key(override, message):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_config(overrides=[override])
    assert info.value.key == key


def test_a_mini_batch_larger_than_the_batch_is_refused_as_verl_refuses_it():
    with pytest.raises(ConfigError, match=r"larger than data.train_batch_size \(4\)") as info:
        load_config(overrides=["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8"])
    assert info.value.key == "actor_rollout_ref.actor.ppo_mini_batch_size"
    # verl asks only that the mini-batch is not larger: it need not divide the batch
    cfg = load_config(overrides=["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 4


def test_top_p_under_the_gateway_is_refused_since_only_the_embedded_source_applies_it():
    with pytest.raises(ConfigError, match="only the embedded rollout source") as info:
        load_config(
            overrides=["agentlightning.agl_base_url=http://127.0.0.1:8080", "actor_rollout_ref.rollout.top_p=0.9"]
        )
    assert info.value.key == "actor_rollout_ref.rollout.top_p"
    assert load_config(overrides=["actor_rollout_ref.rollout.top_p=0.9"]).actor_rollout_ref.rollout.top_p == 0.9


def test_boundary_values_are_accepted():
    cfg = load_config(
        overrides=[
            "actor_rollout_ref.rollout.top_p=1",
            "actor_rollout_ref.rollout.temperature=0",
            "actor_rollout_ref.actor.clip_ratio=0",
            "trainer.total_training_steps=1",
            "trainer.total_training_steps=null",
            "agentlightning.reward_fillna_value=-1",
            "actor_rollout_ref.actor.grad_clip=inf",
        ]
    )
    assert cfg.trainer.total_training_steps is None
