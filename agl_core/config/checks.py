"""The config's validation: each key's rule, then the checks that span keys; each raises a
:class:`ConfigError` naming the key.

Every numeric key that can do harm has a range, declared beside its field in the schema
(:func:`~agl_core.config.schema.checked`): a value outside it would not fail later but train
wrongly (a negative gradient-clip bound flips the gradient's sign, a negative clip ratio inverts
PPO's trust region) or train nothing (no PPO epoch, no step). Sizes follow the rules verl checks
for the same keys, so a config that passes here is not refused later by verl.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from agl_core.config.errors import ConfigError
from agl_core.config.schema import schema_rules
from agl_core.fields import is_int

__all__ = ["KL_IN_REWARD_REFUSED", "row_length_keys", "validate"]

KL_IN_REWARD_REFUSED = (
    "is true, but agl computes a rollout's advantage from its final reward, where a per-token KL penalty has "
    "no place: put the KL term in the loss instead (actor_rollout_ref.actor.use_kl_loss=true)"
)

# (switch, budget) of the token-budget micro-batches (agl_core.stages.micro_batches): the update's and
# the old and reference log-probs' passes.
MICRO_BATCH_KEYS = (
    ("actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
    ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
)


def validate(cfg: DictConfig) -> None:
    """Every key's rule (declared beside its field in :mod:`agl_core.config.schema`), then the checks
    that span keys; raise :class:`ConfigError`."""
    for key, rule in schema_rules():
        rule.check(key, OmegaConf.select(cfg, key))
    _validate_sizes(cfg)
    _validate_gateway_keys(cfg)
    _validate_micro_batch_keys(cfg)
    _validate_record_keys(cfg)
    if cfg.algorithm.use_kl_in_reward:
        raise ConfigError("algorithm.use_kl_in_reward", KL_IN_REWARD_REFUSED)
    top_p = cfg.actor_rollout_ref.rollout.top_p
    if cfg.agentlightning.agl_base_url is not None and top_p != 1:
        raise ConfigError(
            "actor_rollout_ref.rollout.top_p",
            f"is {top_p}, but only the embedded rollout source (agentlightning.agl_base_url: null) applies it; "
            "the gateway forwards each agent's own top_p: set it in the agent and leave this at 1.0",
        )


def _validate_sizes(cfg: DictConfig) -> None:
    """Batch sizes in the relation verl's ``ActorConfig.validate`` requires (mini-batch at most the batch):
    a step's rows could otherwise never make a whole PPO mini-batch, and nothing would be trained."""
    train = cfg.data.train_batch_size
    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    if mini > train:
        raise ConfigError(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"is {mini}, larger than data.train_batch_size ({train}): a step could never fill one PPO mini-batch "
            "and would train nothing; make it at most the batch size",
        )
    if cfg.agentlightning.async_rollout.enabled:
        size = cfg.agentlightning.async_rollout.async_train_batch_size
        if not is_int(size) or size <= train:
            raise ConfigError(
                "agentlightning.async_rollout.async_train_batch_size",
                f"must be an integer greater than data.train_batch_size ({train}) when async rollout is enabled, "
                f"got {size!r}",
            )


def row_length_keys(cfg: DictConfig) -> tuple[str, str]:
    """The keys that bound a training row's prompt and response: verl's ``data.max_*_length`` for the
    ``transition`` level, ``agentlightning.trace_aggregator.trajectory_max_*`` for every other level."""
    if cfg.agentlightning.trace_aggregator.level == "transition":
        return "data.max_prompt_length", "data.max_response_length"
    prefix = "agentlightning.trace_aggregator.trajectory_max_"
    return prefix + "prompt_length", prefix + "response_length"


def _validate_micro_batch_keys(cfg: DictConfig) -> None:
    """Budgets are positive integers, and one in use holds the longest row the level's limits let
    through (as verl asks of its ``max_token_len``), so no row ever exceeds its micro-batch budget."""
    prompt_key, response_key = row_length_keys(cfg)
    longest = OmegaConf.select(cfg, prompt_key) + OmegaConf.select(cfg, response_key)
    limits = f"{prompt_key} + {response_key} = {longest}"
    aggregator = cfg.agentlightning.trace_aggregator
    total = aggregator.trajectory_max_total_length  # a cap on every level but transition's
    if aggregator.level != "transition" and total is not None and total < longest:
        longest, limits = total, f"agentlightning.trace_aggregator.trajectory_max_total_length = {total}"
    for switch, budget in MICRO_BATCH_KEYS:
        tokens = OmegaConf.select(cfg, budget)
        if OmegaConf.select(cfg, switch) and tokens < longest:
            raise ConfigError(
                budget,
                f"is {tokens}, less than the longest row ({limits}); raise it or turn {switch} off",
            )


def _validate_record_keys(cfg: DictConfig) -> None:
    """``agentlightning.replay`` names a recording (a file, or a run directory holding
    ``rollouts.jsonl``), not this run's own, and replaces the gateway."""
    agl = cfg.agentlightning
    if agl.replay is None:
        return
    path = Path(os.path.expanduser(str(agl.replay)))
    recorded = path / "rollouts.jsonl" if path.is_dir() else path
    if not recorded.is_file():
        raise ConfigError(
            "agentlightning.replay", f"{path} is neither a rollout recording nor a run directory holding rollouts.jsonl"
        )
    own = Path(os.path.expanduser(str(cfg.trainer.default_local_dir))) / "rollouts.jsonl"
    if agl.record_rollouts and recorded.resolve() == own.resolve():
        raise ConfigError(
            "agentlightning.replay",
            f"{path} is this run's own recording: record a replayed run into another trainer.default_local_dir",
        )
    if agl.agl_base_url is not None or agl.async_rollout.enabled:
        raise ConfigError(
            "agentlightning.replay",
            "a replayed run runs no agents: unset agentlightning.agl_base_url and async_rollout.enabled",
        )


def _validate_gateway_keys(cfg: DictConfig) -> None:
    low = cfg.agentlightning.gateway.poll_interval_min_seconds
    if cfg.agentlightning.gateway.poll_interval_max_seconds < low:
        raise ConfigError(
            "agentlightning.gateway.poll_interval_max_seconds", f"must be at least poll_interval_min_seconds ({low})"
        )
    backoff = cfg.agentlightning.gateway.retry_backoff_seconds
    if cfg.agentlightning.gateway.retry_backoff_max_seconds < backoff:
        raise ConfigError(
            "agentlightning.gateway.retry_backoff_max_seconds", f"must be at least retry_backoff_seconds ({backoff})"
        )
