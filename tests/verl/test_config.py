"""The verl backend's config: verl's real defaults + agl's section + Agent Lightning's overlay, and its errors."""

from __future__ import annotations

import textwrap

import pytest
from omegaconf import OmegaConf

from agl_core.config import ConfigError, to_yaml

pytestmark = pytest.mark.verl

verl_config = pytest.importorskip("agl_backend_verl.config")


@pytest.fixture
def user_yaml(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        textwrap.dedent(
            """
            data:
              train_batch_size: 4
            actor_rollout_ref:
              actor:
                ppo_mini_batch_size: 2
              model:
                path: /models/tiny
                override_config:
                  attn_implementation: eager
              rollout:
                n: 2
            agentlightning:
              agl_base_url: http://127.0.0.1:8080
              agl_key: s3cret-key
            """
        )
    )
    return path


def test_verl_defaults_overlay_and_user_values_compose(user_yaml):
    cfg = verl_config.load_verl_config(user_yaml, ["trainer.total_training_steps=3"])
    # verl's own defaults, untouched where nobody set them
    assert cfg.algorithm.lam == 1.0
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.critic.ppo_epochs == 1
    # interpolations resolved: rollout.n_gpus_per_node follows trainer.n_gpus_per_node
    assert cfg.actor_rollout_ref.rollout.n_gpus_per_node == cfg.trainer.n_gpus_per_node == 8
    # Agent Lightning's overlay
    assert cfg.algorithm.enable_rollout_level_advantage is True
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "per_rollout_mean"
    assert cfg.actor_rollout_ref.actor.calculate_entropy is True
    assert cfg.agentlightning.trace_aggregator.level == "trajectory"
    assert cfg.agentlightning.backend == "verl"
    # the user's file (a free-form mapping accepts new keys) and overrides
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "eager"
    assert cfg.actor_rollout_ref.rollout.n == 2
    assert cfg.trainer.total_training_steps == 3
    assert "s3cret-key" not in to_yaml(cfg)


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("data.no_such_key=1", "data.no_such_key", "unknown key"),
        ("actor_rollout_ref.actor.no_such_key=1", "actor_rollout_ref.actor.no_such_key", "unknown key"),
        ("actor_rollout_ref.actor.clip_ratio=wide", "actor_rollout_ref.actor.clip_ratio", "must be a float"),
        ("actor_rollout_ref.actor.use_kl_loss=3", "actor_rollout_ref.actor.use_kl_loss", "must be a bool"),
        ("trainer.logger=console", "trainer.logger", "must be a list"),
        ("agentlightning.rollout_timeout_seconds=soon", "agentlightning.rollout_timeout_seconds", "Integer"),
        (
            "agentlightning.async_rollout.enabled=true",
            "agentlightning.async_rollout.async_train_batch_size",
            "greater than",
        ),
        ("algorithm.adv_estimator=remax", "algorithm.adv_estimator", "not supported"),
        ("algorithm.adv_estimator=gae", "algorithm.adv_estimator", "per-token"),
        # the core's ranges and relations hold under verl too
        ("actor_rollout_ref.actor.grad_clip=-1", "actor_rollout_ref.actor.grad_clip", "greater than 0"),
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "larger than data.train_batch_size",
        ),
        ("trainer.total_training_steps=0", "trainer.total_training_steps", "positive integer or null"),
        # verl clips at optim.clip_grad and never reads grad_clip: a difference would be ignored silently
        ("actor_rollout_ref.actor.grad_clip=0.5", "actor_rollout_ref.actor.grad_clip", "give both the same value"),
        ("actor_rollout_ref.actor.optim.clip_grad=0.5", "actor_rollout_ref.actor.grad_clip", "verl clips gradients at"),
        ("ray_kwargs.ray_init.address=head-node", "ray_kwargs.ray_init.address", "must be HOST:PORT"),
        ("ray_kwargs.ray_init.address=10.0.0.1:gcs", "ray_kwargs.ray_init.address", "must be HOST:PORT"),
        # accepted and computing nothing in verl 0.9.1
        (
            "actor_rollout_ref.actor.use_prefix_grouper=true",
            "actor_rollout_ref.actor.use_prefix_grouper",
            "computes nothing shared",
        ),
    ],
)
def test_errors_name_the_key(user_yaml, override, key, fragment):
    with pytest.raises(ConfigError) as info:
        verl_config.load_verl_config(user_yaml, [override])
    assert info.value.key == key
    assert fragment in str(info.value)


def test_the_same_gradient_clip_under_both_keys_is_accepted(user_yaml):
    cfg = verl_config.load_verl_config(
        user_yaml, ["actor_rollout_ref.actor.grad_clip=0.5", "actor_rollout_ref.actor.optim.clip_grad=0.5"]
    )
    assert cfg.actor_rollout_ref.actor.optim.clip_grad == 0.5


def test_async_batch_size_rule_accepts_a_larger_in_flight_size(user_yaml):
    cfg = verl_config.load_verl_config(
        user_yaml,
        ["agentlightning.async_rollout.enabled=true", "agentlightning.async_rollout.async_train_batch_size=6"],
    )
    assert cfg.agentlightning.async_rollout.async_train_batch_size == 6


def test_gae_is_accepted_when_advantages_are_per_row(user_yaml):
    cfg = verl_config.load_verl_config(
        user_yaml, ["algorithm.adv_estimator=gae", "algorithm.enable_rollout_level_advantage=false"]
    )
    assert cfg.algorithm.adv_estimator == "gae"


def test_an_int_is_accepted_for_a_float(user_yaml):
    cfg = verl_config.load_verl_config(user_yaml, ["actor_rollout_ref.actor.clip_ratio=1"])
    assert cfg.actor_rollout_ref.actor.clip_ratio == 1


def test_rollout_level_key_is_refused_by_verls_dataclass_but_not_by_what_we_hand_to_verl(user_yaml):
    from verl.trainer.config import AlgoConfig
    from verl.utils.config import omega_conf_to_dataclass

    cfg = verl_config.load_verl_config(user_yaml, ["algorithm.adv_estimator=rloo"])
    with pytest.raises(Exception, match="enable_rollout_level_advantage"):
        omega_conf_to_dataclass(OmegaConf.masked_copy(cfg, ["algorithm"]).algorithm, AlgoConfig)
    algo = omega_conf_to_dataclass(verl_config.verl_algorithm_config(cfg), AlgoConfig)
    assert isinstance(algo, AlgoConfig)
    assert algo.adv_estimator == "rloo"
    assert cfg.algorithm.enable_rollout_level_advantage is True  # the user's config still holds it


def test_missing_verl_is_a_config_error(monkeypatch):
    monkeypatch.setattr(verl_config.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as info:
        verl_config.generated_defaults_path()
    assert info.value.key == "agentlightning.backend"


def test_floats_where_verl_writes_an_int_default_are_accepted_only_for_float_settings():
    cfg = verl_config.load_verl_config(
        None, ["actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.val_kwargs.temperature=0.0"]
    )
    assert cfg.actor_rollout_ref.rollout.top_p == 0.9
    with pytest.raises(ConfigError) as refused:
        verl_config.load_verl_config(None, ["actor_rollout_ref.rollout.top_k=0.5"])
    assert refused.value.key == "actor_rollout_ref.rollout.top_k"


def test_keys_verls_dataclasses_take_beyond_its_defaults_reach_verls_dataclasses(tmp_path):
    """``fsdp_config.mixed_precision`` (a field verl's YAML defaults omit) and a list of ``target_modules``
    (a default of ``"all-linear"``) load under backend verl and build verl's dataclasses."""
    pytest.importorskip("verl")
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import FSDPActorConfig, HFModelConfig

    from tests.helpers.corridor_policy import build_corridor_policy

    policy = build_corridor_policy(tmp_path / "policy")
    cfg = verl_config.load_verl_config(
        None,
        [
            f"actor_rollout_ref.model.path={policy}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        ],
    )
    model = omega_conf_to_dataclass(cfg.actor_rollout_ref.model, HFModelConfig)
    assert list(model.target_modules) == ["q_proj", "v_proj"]
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, FSDPActorConfig) and actor.fsdp_config.mixed_precision == {"param_dtype": "bf16"}
    engine = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.fsdp_config)
    assert engine.mixed_precision == {"param_dtype": "bf16"}
    # an omitted field nobody set stays out of what verl gets, as without agl
    assert "mixed_precision" not in cfg.actor_rollout_ref.ref.fsdp_config.keys()


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        (
            "actor_rollout_ref.actor.fsdp_config.mixed_precison.param_dtype=bf16",
            "actor_rollout_ref.actor.fsdp_config.mixed_precison",
            "did you mean 'mixed_precision'",
        ),
        (
            "actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16",
            "actor_rollout_ref.actor.fsdp_config.mixed_precision",
            "must be a mapping",
        ),
        ("actor_rollout_ref.model.lora_rank=[8]", "actor_rollout_ref.model.lora_rank", "must be a int"),
    ],
)
def test_keys_verls_dataclasses_do_not_take_are_refused_by_name(override, key, fragment):
    with pytest.raises(ConfigError) as info:
        verl_config.load_verl_config(None, [override])
    assert info.value.key == key and fragment in info.value.message


def test_a_section_verls_dataclass_refuses_is_a_config_error_naming_it(user_yaml):
    """verl's validate_config builds the actor's section into its dataclass inside Hydra's instantiate:
    what the dataclass refuses reads as verl's reason, under the section's key, not as an internal error."""
    cfg = verl_config.load_verl_config(
        user_yaml, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "trainer.n_gpus_per_node=1"]
    )
    with pytest.raises(ConfigError) as info:
        verl_config.check_with_verl(cfg)
    assert info.value.key == "actor_rollout_ref.actor"
    assert "verl refuses the config: [actor] Please set at least one of 'actor.ppo_micro_batch_size'" in str(info.value)
