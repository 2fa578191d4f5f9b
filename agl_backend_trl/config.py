"""The ``trl`` backend's config: the core schema plus a ``trl`` section of TRL ``GRPOConfig`` keys.

Every key a user sets under ``trl.`` is honoured (:data:`HONOURED`), checked against the agl key
that holds the same setting (:data:`PAIRS`: agl's key wins, and the TRL key is refused unless it
says the same), or refused by name with the reason (:func:`refusal`); a key that is no
``GRPOConfig`` field is refused as unknown. :func:`grpo_config` builds the ``GRPOConfig`` the
trainer gets: agl's values for the paired keys, the honoured keys as set, and the values agl's loop
needs (no saving, logging or reporting of TRL's own: agl's loop checkpoints and its metric sinks log).

The agl keys this backend does not implement are refused too (:func:`check_trl_config`): weights in
another dtype than float32, agl's lr schedule keys (the schedule is TRL's), another engine than the
in-process one.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf, open_dict

from agl_core import (
    ConfigError,
    ConfigFile,
    check_rollout_source,
    check_text_policy,
    default_config,
    merge_config,
    validate_config,
)
from agl_core.backends.dropout import DISABLE_DROPOUT
from agl_core.backends.lora import check_lora_keys
from agl_core.backends.precision import MIXED_PRECISION_KEY, MODEL_DTYPE_KEY, dtype_names

if TYPE_CHECKING:
    from trl import GRPOConfig

__all__ = [
    "AGL_KEYS",
    "CALLBACKS_KEY",
    "HONOURED",
    "PAIRS",
    "SECTION",
    "SUPPORTED_TRL",
    "check_trl_config",
    "grpo_config",
    "grpo_config_class",
    "load_trl_config",
    "refusal",
]

SECTION = "trl"
CALLBACKS_KEY = "callbacks"
"""``trl.callbacks``: the ``transformers.TrainerCallback`` classes the trainer is given, each an import
path ``module:Class`` (built without arguments) or a one-key mapping ``{module:Class: {argument:
value}}`` (built with those keyword arguments); the one key of the section that is not a
``GRPOConfig`` field."""

HONOURED = frozenset(
    {
        "lr_scheduler_type",  # the schedule, stepped once per training step over trainer.total_training_steps
        "lr_scheduler_kwargs",
        "warmup_steps",
        "warmup_ratio",
        "optim",  # transformers' optimizer by name (adamw_torch unless set)
        "optim_args",
        "adam_epsilon",
        "gradient_checkpointing_kwargs",
        "use_cpu",
    }
)
"""``GRPOConfig`` keys a user sets under ``trl.`` as TRL reads them."""

DEFAULTS: Mapping[str, Any] = {"lr_scheduler_type": "constant", "optim": "adamw_torch"}
"""Honoured keys whose default here is not TRL's: the schedule and optimizer of agl's other backends
(a constant lr, ``torch.optim.AdamW``), so that an unset ``trl`` section trains as they do."""

LR = "actor_rollout_ref.actor.optim.lr"
KL = "actor_rollout_ref.actor.use_kl_loss/kl_loss_coef"


def _kl_beta(config: DictConfig) -> float:
    actor = config.actor_rollout_ref.actor
    return float(actor.kl_loss_coef) if actor.use_kl_loss else 0.0


def _clip_ratio(config: DictConfig, key: str) -> float:
    actor = config.actor_rollout_ref.actor
    return float(actor.clip_ratio if actor[key] is None else actor[key])


def _scale(value: Any) -> Any:
    """``scale_rewards`` as TRL normalises it (a bool reads as ``group`` / ``none``)."""
    return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value


# TRL key -> (the agl key holding the same setting, what that key makes the TRL value, the user's value normalised)
PAIRS: Mapping[str, tuple[str, Callable[[DictConfig], Any], Callable[[Any], Any]]] = {
    "learning_rate": (LR, lambda c: float(c.actor_rollout_ref.actor.optim.lr), float),
    "num_generations": ("actor_rollout_ref.rollout.n", lambda c: int(c.actor_rollout_ref.rollout.n), int),
    "beta": (KL, _kl_beta, float),
    "max_completion_length": ("data.max_response_length", lambda c: int(c.data.max_response_length), int),
    "scale_rewards": (
        "algorithm.norm_adv_by_std_in_grpo",
        lambda c: "group" if c.algorithm.norm_adv_by_std_in_grpo else "none",
        _scale,
    ),
    "weight_decay": (
        "actor_rollout_ref.actor.optim.weight_decay",
        lambda c: float(c.actor_rollout_ref.actor.optim.weight_decay),
        float,
    ),
    "adam_beta1": (
        "actor_rollout_ref.actor.optim.betas",
        lambda c: float(c.actor_rollout_ref.actor.optim.betas[0]),
        float,
    ),
    "adam_beta2": (
        "actor_rollout_ref.actor.optim.betas",
        lambda c: float(c.actor_rollout_ref.actor.optim.betas[1]),
        float,
    ),
    "max_grad_norm": ("actor_rollout_ref.actor.grad_clip", lambda c: float(c.actor_rollout_ref.actor.grad_clip), float),
    "num_iterations": ("actor_rollout_ref.actor.ppo_epochs", lambda c: int(c.actor_rollout_ref.actor.ppo_epochs), int),
    "entropy_coef": (
        "actor_rollout_ref.actor.entropy_coeff",
        lambda c: float(c.actor_rollout_ref.actor.entropy_coeff),
        float,
    ),
    "bf16": (
        f"{MIXED_PRECISION_KEY}.param_dtype",
        lambda c: dtype_names(c.actor_rollout_ref.actor.fsdp_config)[1] == "bfloat16",
        bool,
    ),
    "gradient_checkpointing": (
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        lambda c: bool(c.actor_rollout_ref.model.enable_gradient_checkpointing),
        bool,
    ),
    "seed": ("trainer.seed", lambda c: int(c.trainer.seed), int),
    # the ratio's clip range, [1 - epsilon, 1 + epsilon_high]: verl's clip_ratio_low / _high (each
    # clip_ratio when unset), as TRL's epsilon_high is epsilon when unset
    "epsilon": ("actor_rollout_ref.actor.clip_ratio_low", lambda c: _clip_ratio(c, "clip_ratio_low"), float),
    "epsilon_high": ("actor_rollout_ref.actor.clip_ratio_high", lambda c: _clip_ratio(c, "clip_ratio_high"), float),
    "disable_dropout": (DISABLE_DROPOUT, lambda c: bool(c.agentlightning.disable_dropout), bool),
}
"""TRL keys for which agl has a key of its own: agl's key wins; the TRL key may be set only to what
agl's says (``trl.loss_type`` has no such pair: agl's loss is ``policy_loss.loss_mode``, always)."""

# Refused keys, by what they belong to in TRL, with the reason given to the user.
_GENERATION = (
    "is TRL's generation or reward setting: agl's agents generate (actor_rollout_ref.rollout.*, "
    "agentlightning.engine) and report the rewards, so the trainer never generates"
)
_LOSS = (
    "is TRL's loss setting: agl's loss replaces TRL's (actor_rollout_ref.actor.policy_loss.loss_mode, "
    "clip_ratio_low/high, entropy_coeff, use_kl_loss)"
)
_UNPROVEN = (
    "is not proven with this backend yet (vLLM generation, DeepSpeed, FSDP, DDP settings of TRL's, "
    "fp16 or tf32, compiled or patched kernels); remove it"
)
_LOOP = (
    "is TRL's training-loop setting: agl runs the loop (trainer.total_training_steps, save_freq, "
    "data.*, trainer.logger for metrics, trainer.default_local_dir for checkpoints)"
)
_LOSS_PREFIXES = ("sapo_", "vespo_", "entropy_coef_", "vllm_importance_sampling_")
_UNPROVEN_PREFIXES = ("vllm_", "fsdp", "ddp_", "deepspeed", "torch_compile", "liger_", "parallelism")
_NAMED: Mapping[str, str] = {
    **dict.fromkeys(
        (
            "loss_type",
            "delta",
            "importance_sampling_level",
            "top_entropy_quantile",
            "use_adaptive_entropy",
            "entropy_target",
            "off_policy_mask_threshold",
            "use_bias_correction_kl",
            "mask_truncated_completions",
            "sync_ref_model",
            "ref_model_mixup_alpha",
            "ref_model_sync_steps",
            "router_aux_loss_coef",
            "label_smoothing_factor",
        ),
        _LOSS,
    ),
    **dict.fromkeys(
        (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "generation_kwargs",
            "chat_template_kwargs",
            "cache_implementation",
            "generation_batch_size",
            "steps_per_generation",
            "num_generations_eval",
            "max_tool_calling_iterations",
            "reward_weights",
            "multi_objective_aggregation",
            "use_transformers_continuous_batching",
            "transformers_continuous_batching_config",
            "use_transformers_paged",
            "pad_to_multiple_of",
            "shuffle_dataset",
            "use_cache",
        ),
        _GENERATION,
    ),
    **dict.fromkeys(
        (
            "use_vllm",
            "ds3_gather_for_generation",
            "fp16",
            "tf32",
            "bf16_full_eval",
            "fp16_full_eval",
            "cast_lm_head_to_fp32",
            "use_liger_kernel",
            "model_init_kwargs",
            "trust_remote_code",
            "local_rank",
            "neftune_noise_alpha",
            "optim_target_modules",
            "average_tokens_across_devices",
            "auto_find_batch_size",
            "accelerator_config",
        ),
        _UNPROVEN,
    ),
}


def refusal(key: str) -> str:
    """Why ``trl.<key>`` (a ``GRPOConfig`` field neither honoured nor paired) is refused."""
    if key in _NAMED:
        return _NAMED[key]
    if key.startswith(_LOSS_PREFIXES):
        return _LOSS
    if key.startswith(_UNPROVEN_PREFIXES):
        return _UNPROVEN
    return _LOOP


SUPPORTED_TRL = "1.16"


def grpo_config_class() -> type[GRPOConfig]:
    """TRL's ``GRPOConfig``, from a TRL this backend supports (1.16.x: ``pip install
    'agl-backend-verl[trl]'``); another TRL, or none, is refused naming the backend key."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("trl")
    except PackageNotFoundError:
        found = None
    if found is None or not found.startswith(f"{SUPPORTED_TRL}."):
        have = "TRL is not installed" if found is None else f"TRL {found} is installed"
        raise ConfigError(
            "agentlightning.backend",
            f"backend 'trl' needs TRL {SUPPORTED_TRL}.x and {have}: pip install 'agl-backend-verl[trl]'",
        )
    from trl import GRPOConfig

    return GRPOConfig


@cache
def grpo_fields() -> frozenset[str]:
    """The fields of TRL's ``GRPOConfig`` (TRL imported here, when a ``trl`` run's config is loaded)."""
    return frozenset(field.name for field in dataclasses.fields(grpo_config_class()) if field.init)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return math.isclose(float(got), want, rel_tol=1e-12, abs_tol=0.0)
    return got == want


def check_trl_section(config: DictConfig) -> None:
    """Each key set under ``trl.``: honoured, equal to its agl key's value, or refused by name."""
    section = config.get(SECTION) or {}
    fields = grpo_fields()
    for key in section:
        name = f"{SECTION}.{key}"
        if key == CALLBACKS_KEY:
            callback_entries(section[key])
        elif key in HONOURED:
            continue
        elif key in PAIRS:
            agl_key, agl_value, normalise = PAIRS[key]
            value = OmegaConf.to_object(section[key]) if OmegaConf.is_config(section[key]) else section[key]
            try:
                got = normalise(value)
            except (TypeError, ValueError):
                raise ConfigError(name, f"must be a value {agl_key} can equal, got {value!r}") from None
            want = agl_value(config)
            if not _same(got, want):
                raise ConfigError(
                    name,
                    f"is {value!r}, but {agl_key} makes it {want!r}: agl's key sets it; remove {name} or set it "
                    "to the same value",
                )
        elif key in fields:
            raise ConfigError(name, refusal(key))
        else:
            hints = difflib.get_close_matches(str(key), sorted(fields | {CALLBACKS_KEY}), n=1)
            hint = hints[0] if hints else None
            raise ConfigError(
                name, "is not a key of TRL's GRPOConfig" + (f"; did you mean {SECTION}.{hint}?" if hint else "")
            )


def callback_entries(value: Any) -> list[tuple[str, dict[str, Any]]]:
    """``trl.callbacks``' entries as ``(module:Class, keyword arguments)``; a malformed one refused by
    its place in the list."""
    key = f"{SECTION}.{CALLBACKS_KEY}"
    value = OmegaConf.to_object(value) if OmegaConf.is_config(value) else value
    if not isinstance(value, (list, tuple)):
        raise ConfigError(key, f"must be a list of import paths module:Class, got {value!r}")
    entries = []
    for i, entry in enumerate(value):
        path, kwargs = next(iter(entry.items())) if isinstance(entry, dict) and len(entry) == 1 else (entry, {})
        kwargs = {} if kwargs is None else kwargs
        if not (isinstance(path, str) and ":" in path) or not isinstance(kwargs, dict):
            raise ConfigError(
                f"{key}[{i}]",
                f"must be an import path module:Class, or {{module:Class: {{argument: value}}}}, got {entry!r}",
            )
        entries.append((path, kwargs))
    return entries


def build_callbacks(config: DictConfig) -> list[Any]:
    """The ``TrainerCallback`` objects ``trl.callbacks`` names, imported and built with their keyword
    arguments; what cannot be is refused naming the entry."""
    import importlib

    from transformers import TrainerCallback

    callbacks = []
    entries = callback_entries((config.get(SECTION) or {}).get(CALLBACKS_KEY, []))
    for i, (path, kwargs) in enumerate(entries):
        key = f"{SECTION}.{CALLBACKS_KEY}[{i}]"
        module, _, name = path.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(key, f"cannot import {path}: {exc}") from None
        if not (isinstance(cls, type) and issubclass(cls, TrainerCallback)):
            raise ConfigError(key, f"{path} is not a transformers.TrainerCallback class")
        try:
            callbacks.append(cls(**kwargs))
        except Exception as exc:  # the class's own check of its arguments, whatever it raises
            raise ConfigError(key, f"{path}(**{kwargs!r}) cannot be built: {type(exc).__name__}: {exc}") from None
    return callbacks


# agl keys and the values this backend trains with, with why another value is refused.
AGL_KEYS: Mapping[str, tuple[Any, str]] = {
    "actor_rollout_ref.actor.optim.lr_scheduler_type": (
        "constant",
        "the lr schedule is TRL's: set trl.lr_scheduler_type (and trl.warmup_steps), stepped once per training step",
    ),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": (0, "the lr schedule is TRL's: set trl.warmup_steps"),
    MODEL_DTYPE_KEY: (
        "fp32",
        "the weights stay float32; TRL's bf16 autocasts the forward passes: set "
        f"{MIXED_PRECISION_KEY}.param_dtype=bf16",
    ),
    "agentlightning.engine": ("builtin", "the policy is served in-process (PolicyServer) only so far"),
}


def check_trl_config(config: DictConfig) -> None:
    """What ``agl check`` and ``agl train`` verify of a ``trl`` run before a model is loaded: the
    ``trl`` section, the agl keys this backend does not implement, that TRL builds a ``GRPOConfig``
    from the result, and that the callbacks import and build."""
    check_trl_section(config)
    folder = Path(str(config.actor_rollout_ref.model.path))
    if not folder.is_dir():
        raise ConfigError("actor_rollout_ref.model.path", f"model folder {folder} does not exist")
    check_text_policy(config, "trl")
    check_lora_keys(config.actor_rollout_ref.model)
    dtype_names(config.actor_rollout_ref.actor.fsdp_config)
    for key, (value, why) in AGL_KEYS.items():
        if OmegaConf.select(config, key) != value:
            raise ConfigError(key, f"backend 'trl' trains with {value!r} only: {why}")
    check_rollout_source(config)
    grpo_config(config, Path(config.trainer.default_local_dir))
    build_callbacks(config)


def grpo_config(config: DictConfig, run_dir: Path) -> GRPOConfig:
    """The ``GRPOConfig`` of a checked run: agl's values for :data:`PAIRS`, the honoured keys as set."""
    GRPOConfig = grpo_config_class()  # noqa: N806 -- the class

    section = config.get(SECTION) or {}
    honoured = _with_warmup({**DEFAULTS, **{k: _plain(section[k]) for k in section if k in HONOURED}}, section)
    values = {key: agl_value(config) for key, (_, agl_value, _) in PAIRS.items()}
    # TRL requires groups of two or more and a generation batch of whole groups; neither is read here.
    values["num_generations"] = max(2, values["num_generations"])
    kwargs = {
        **values,
        **honoured,
        "output_dir": str(run_dir / "trl"),
        "per_device_train_batch_size": values["num_generations"],
        "gradient_accumulation_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "fp16": False,
        "dataloader_pin_memory": False,
    }
    try:
        return GRPOConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        if "use_cpu" in str(exc):  # bf16 on a machine without a GPU
            raise ConfigError(f"{SECTION}.use_cpu", f"TRL needs it set on this machine: {exc}") from None
        raise ConfigError(SECTION, f"TRL refuses the GRPOConfig these keys make: {exc}") from None


def _with_warmup(honoured: dict[str, Any], section: Any) -> dict[str, Any]:
    """``honoured`` with a warmup that takes effect: TRL's ``constant`` schedule ignores
    ``warmup_steps`` / ``warmup_ratio``, so with agl's default schedule a warmup makes it
    ``constant_with_warmup``, and a ``constant`` the user set beside a warmup is refused naming both."""
    warmup = next((f"{SECTION}.{k}={honoured[k]}" for k in ("warmup_steps", "warmup_ratio") if honoured.get(k)), None)
    if warmup is None or honoured["lr_scheduler_type"] != "constant":
        return honoured
    if "lr_scheduler_type" in section:
        raise ConfigError(
            f"{SECTION}.lr_scheduler_type",
            f"is constant, which ignores {warmup}: set constant_with_warmup (or another schedule) to warm "
            "up, or remove the warmup",
        )
    return {**honoured, "lr_scheduler_type": "constant_with_warmup"}


def _plain(value: Any) -> Any:
    return OmegaConf.to_object(value) if OmegaConf.is_config(value) else value


def trl_base() -> DictConfig:
    """The core defaults with an open ``trl`` section (its keys are checked by :func:`check_trl_section`)."""
    base = default_config()
    with open_dict(base):
        base[SECTION] = {}
    OmegaConf.set_struct(base[SECTION], False)
    return base


def load_trl_config(path: str | ConfigFile | None = None, overrides: Sequence[str] = ()) -> DictConfig:
    """The validated run config of backend ``trl``: the core schema's keys, then the ``trl`` section's."""
    config = merge_config(path, overrides, base=trl_base())
    validate_config(config)
    check_trl_section(config)
    return config
