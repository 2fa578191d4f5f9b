"""Checks that span keys or that types alone cannot express; each raises a :class:`ConfigError` naming the key."""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf

from agl_core.config.errors import ConfigError
from agl_core.config.schema import LOSS_NORMALIZATION_MODES

__all__ = ["row_length_keys", "validate"]

# (switch, budget) key pairs of the token-budget micro-batches (agl_core.stages.micro_batches).
MICRO_BATCH_KEYS = (
    ("actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
    ("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
)


def _positive(cfg: DictConfig, key: str, allow_none: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(key, f"must be a positive integer, got {value!r}")


def validate(cfg: DictConfig) -> None:
    """Checks that span keys or that types alone cannot express; raise :class:`ConfigError`."""
    agl = cfg.agentlightning
    hooks = agl.hooks
    if hooks is not None and not isinstance(hooks, str):
        if not isinstance(hooks, ListConfig) or not all(isinstance(h, str) for h in hooks):
            raise ConfigError("agentlightning.hooks", f"must be a path or a list of paths, got {hooks!r}")
    for key in (
        "data.train_batch_size",
        "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "agentlightning.rollout_timeout_seconds",
        "agentlightning.trace_aggregator.trajectory_max_prompt_length",
        "agentlightning.trace_aggregator.trajectory_max_response_length",
    ):
        _positive(cfg, key)
    _positive(cfg, "agentlightning.max_ppo_update_times", allow_none=True)
    if agl.loss_normalization not in LOSS_NORMALIZATION_MODES:
        raise ConfigError(
            "agentlightning.loss_normalization",
            f"must be one of {', '.join(LOSS_NORMALIZATION_MODES)}, got {agl.loss_normalization!r}",
        )
    _positive(cfg, "agentlightning.trace_aggregator.mismatch_max_length")
    sample_size = agl.trace_aggregator.mismatch_sample_size
    if isinstance(sample_size, bool) or not isinstance(sample_size, int) or sample_size < 0:
        raise ConfigError(
            "agentlightning.trace_aggregator.mismatch_sample_size",
            f"must be a non-negative integer, got {sample_size!r}",
        )
    _validate_gateway_keys(cfg)
    _validate_micro_batch_keys(cfg)
    _validate_engine_keys(cfg)
    _validate_torch_backend_keys(cfg)
    if agl.async_rollout.enabled:
        size = agl.async_rollout.async_train_batch_size
        train = cfg.data.train_batch_size
        if not isinstance(size, int) or isinstance(size, bool) or size <= train:
            raise ConfigError(
                "agentlightning.async_rollout.async_train_batch_size",
                f"must be an integer greater than data.train_batch_size ({train}) when async rollout is enabled, got {size!r}",
            )
    url = agl.agl_base_url
    if url is not None and not str(url).startswith(("http://", "https://")):
        raise ConfigError("agentlightning.agl_base_url", f"must be an http(s) URL or null, got {url!r}")
    entropy_coeff = OmegaConf.select(cfg, "actor_rollout_ref.actor.entropy_coeff")
    if not 0 <= entropy_coeff < float("inf"):
        raise ConfigError("actor_rollout_ref.actor.entropy_coeff", f"must be a finite number of 0 or more, got {entropy_coeff!r}")
    clip_c = OmegaConf.select(cfg, "actor_rollout_ref.actor.clip_ratio_c")
    if clip_c is not None and clip_c <= 1.0:
        raise ConfigError("actor_rollout_ref.actor.clip_ratio_c", f"must be greater than 1.0, got {clip_c}")


def row_length_keys(cfg: DictConfig) -> tuple[str, str]:
    """The keys that bound a training row's prompt and response: verl's ``data.max_*_length`` for the
    ``transition`` level, ``agentlightning.trace_aggregator.trajectory_max_*`` for every other level."""
    if cfg.agentlightning.trace_aggregator.level == "transition":
        return "data.max_prompt_length", "data.max_response_length"
    prefix = "agentlightning.trace_aggregator.trajectory_max_"
    return prefix + "prompt_length", prefix + "response_length"


def _validate_micro_batch_keys(cfg: DictConfig) -> None:
    """A budget in use must hold the longest row the limits let through (as verl asks of its
    ``max_token_len``), so no row ever exceeds its micro-batch budget."""
    prompt_key, response_key = row_length_keys(cfg)
    longest = OmegaConf.select(cfg, prompt_key) + OmegaConf.select(cfg, response_key)
    for switch, budget in MICRO_BATCH_KEYS:
        _positive(cfg, budget)
        if OmegaConf.select(cfg, switch) and OmegaConf.select(cfg, budget) < longest:
            raise ConfigError(
                budget,
                f"is {OmegaConf.select(cfg, budget)}, less than the longest row ({prompt_key} + {response_key} = {longest}); "
                f"raise it or turn {switch} off",
            )


def _choice(cfg: DictConfig, key: str, choices: tuple[str, ...]) -> None:
    value = OmegaConf.select(cfg, key)
    if value not in choices:
        raise ConfigError(key, f"must be one of {', '.join(choices)}, got {value!r}")


def _validate_gateway_keys(cfg: DictConfig) -> None:
    _choice(cfg, "agentlightning.failed_rollout_policy", ("skip", "train"))
    _choice(cfg, "agentlightning.gateway.restart_policy", ("reenqueue", "fail"))
    for key in (
        "agentlightning.gateway.http_timeout_seconds",
        "agentlightning.gateway.poll_interval_min_seconds",
        "agentlightning.gateway.liveness_check_seconds",
        "agentlightning.gateway.drain_timeout_seconds",
    ):
        value = OmegaConf.select(cfg, key)
        if not value > 0:
            raise ConfigError(key, f"must be greater than 0, got {value!r}")
    for key in (
        "agentlightning.rollout_timeout_grace_seconds",
        "agentlightning.gateway.retry_backoff_seconds",
        "agentlightning.gateway.max_retries",
        "agentlightning.gateway.max_reenqueues",
        "agentlightning.gateway.pause_retry_after_seconds",
    ):
        value = OmegaConf.select(cfg, key)
        if value < 0:
            raise ConfigError(key, f"must be 0 or more, got {value!r}")
    low = cfg.agentlightning.gateway.poll_interval_min_seconds
    if cfg.agentlightning.gateway.poll_interval_max_seconds < low:
        raise ConfigError("agentlightning.gateway.poll_interval_max_seconds", f"must be at least poll_interval_min_seconds ({low})")
    backoff = cfg.agentlightning.gateway.retry_backoff_seconds
    if cfg.agentlightning.gateway.retry_backoff_max_seconds < backoff:
        raise ConfigError("agentlightning.gateway.retry_backoff_max_seconds", f"must be at least retry_backoff_seconds ({backoff})")


def _validate_torch_backend_keys(cfg: DictConfig) -> None:
    _positive(cfg, "agentlightning.embedded.max_workers")
    _positive(cfg, "agentlightning.torch.num_threads", allow_none=True)
    device = cfg.agentlightning.torch.device
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ConfigError("agentlightning.torch.device", f"must be auto, cpu, cuda or cuda:N, got {device!r}")
    _choice(cfg, "trainer.resume_mode", ("auto", "disable"))
    _positive(cfg, "data.val_batch_size", allow_none=True)
    if not cfg.actor_rollout_ref.rollout.val_kwargs.temperature >= 0:
        raise ConfigError("actor_rollout_ref.rollout.val_kwargs.temperature", "must be 0 (greedy) or more")


def _validate_engine_keys(cfg: DictConfig) -> None:
    _choice(cfg, "agentlightning.engine", ("builtin", "vllm"))
    for key in ("agentlightning.vllm.startup_timeout_seconds", "agentlightning.vllm.pause_timeout_seconds"):
        value = OmegaConf.select(cfg, key)
        if not value > 0:
            raise ConfigError(key, f"must be greater than 0, got {value!r}")
    _positive(cfg, "agentlightning.vllm.kv_cache_space_gib")
    _positive(cfg, "agentlightning.vllm.max_model_len")
    port = cfg.agentlightning.vllm.port
    if not 0 <= port <= 65535:
        raise ConfigError("agentlightning.vllm.port", f"must be 0 (a free port) or a port number, got {port!r}")
    url = cfg.agentlightning.vllm.url
    if url is not None and not str(url).startswith(("http://", "https://")):
        raise ConfigError("agentlightning.vllm.url", f"must be an http(s) URL or null, got {url!r}")
