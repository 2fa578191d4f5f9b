"""LoRA with PEFT under verl's keys in ``actor_rollout_ref.model``, for the backends that train one
(the torch backend, the trl backend through TRL's ``peft_config``).

``lora_rank`` > 0 turns it on; ``lora_alpha`` scales the adapter; ``target_modules`` (a list of module
names, or ``all-linear``: every linear layer but the output head) and ``exclude_modules`` pick the
layers that get one, as PEFT's ``LoraConfig`` reads them (verl hands them to it the same way, with
``bias: none``, no dropout): :func:`lora_config`. ``lora_adapter_path`` continues training a saved
PEFT adapter (a folder with ``adapter_config.json``, as a LoRA run's checkpoints hold): its own config
is used, as in verl, its rank and alpha must equal ``lora_rank`` and ``lora_alpha``, and its weights
are loaded into the new adapter (:func:`load_adapter`).

Only the adapter's weights train (PEFT freezes the base model) and go into the optimizer. The
reference policy of ``actor.use_kl_loss`` is the base model, i.e. this model with its adapters
disabled (:func:`base_policy`), so a LoRA run keeps no second copy of the weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl_core.config import ConfigError

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig
    from peft import LoraConfig, PeftModel

__all__ = ["base_policy", "check_lora_keys", "load_adapter", "lora_config", "lora_enabled", "with_lora"]

KEY = "actor_rollout_ref.model"
ADAPTER_CONFIG = "adapter_config.json"


def lora_enabled(model_cfg: DictConfig) -> bool:
    return int(model_cfg.lora_rank) > 0


def _module_names(value: Any, key: str, *, allow_none: bool) -> str | list[str] | None:
    """``target_modules`` / ``exclude_modules`` as PEFT takes them: a name (or regex), or a list of names."""
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value:
        return value
    names = list(value) if not isinstance(value, (str, bytes)) and hasattr(value, "__iter__") else None
    if names and all(isinstance(n, str) and n for n in names):
        return names
    what = "a module name, all-linear or a non-empty list of module names" + (" or null" if allow_none else "")
    raise ConfigError(key, f"must be {what}, got {value!r}")


def _adapter_config(path: str, model_cfg: DictConfig) -> dict[str, Any]:
    """The saved adapter's config, checked against what the keys say and what this backend can train."""
    key = f"{KEY}.lora_adapter_path"
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise ConfigError(key, f"{path} has no {ADAPTER_CONFIG} (a PEFT adapter folder is needed)")
    saved = json.loads(file.read_text())
    if saved.get("peft_type") != "LORA":
        raise ConfigError(key, f"the adapter at {path} is a {saved.get('peft_type')} adapter; agl trains LoRA only")
    for option, what in (
        ("use_dora", "DoRA"),
        ("modules_to_save", "modules_to_save"),
        ("target_parameters", "target_parameters"),
    ):
        if saved.get(option):
            raise ConfigError(key, f"the adapter at {path} uses {what}, which agl does not train")
    for name, saved_name in (("lora_rank", "r"), ("lora_alpha", "lora_alpha")):
        if saved.get(saved_name) != model_cfg[name]:
            raise ConfigError(
                f"{KEY}.{name}",
                f"is {model_cfg[name]!r}, but the adapter at {path} has {saved_name}={saved.get(saved_name)!r};"
                " set them equal",
            )
    return saved


def check_lora_keys(model_cfg: DictConfig) -> None:
    """What can be checked without the model: the values and, with ``lora_adapter_path``, the adapter's config."""
    rank = model_cfg.lora_rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"{KEY}.lora_rank", f"must be 0 (LoRA off) or a positive integer, got {rank!r}")
    if rank == 0:
        if model_cfg.lora_adapter_path:
            raise ConfigError(
                f"{KEY}.lora_adapter_path", "is set, but lora_rank is 0 (LoRA off); set lora_rank to the adapter's rank"
            )
        return
    alpha = model_cfg.lora_alpha
    if isinstance(alpha, bool) or not isinstance(alpha, int) or alpha <= 0:
        raise ConfigError(f"{KEY}.lora_alpha", f"must be a positive integer, got {alpha!r}")
    _module_names(model_cfg.target_modules, f"{KEY}.target_modules", allow_none=False)
    _module_names(model_cfg.exclude_modules, f"{KEY}.exclude_modules", allow_none=True)
    if model_cfg.lora_adapter_path:
        _adapter_config(str(model_cfg.lora_adapter_path), model_cfg)


def lora_config(model_cfg: DictConfig) -> LoraConfig:
    """The adapter to train, of keys :func:`check_lora_keys` passed: the saved adapter's config
    (``lora_adapter_path``, trainable), else a new one from the keys."""
    from peft import LoraConfig, TaskType

    if model_cfg.lora_adapter_path:
        saved = LoraConfig.from_pretrained(str(model_cfg.lora_adapter_path))
        saved.inference_mode = False
        return saved
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=int(model_cfg.lora_rank),
        lora_alpha=int(model_cfg.lora_alpha),
        target_modules=_module_names(model_cfg.target_modules, f"{KEY}.target_modules", allow_none=False),
        exclude_modules=_module_names(model_cfg.exclude_modules, f"{KEY}.exclude_modules", allow_none=True),
        bias="none",
    )


def with_lora(model: torch.nn.Module, model_cfg: DictConfig) -> PeftModel:
    """``model`` with the adapter of :func:`lora_config` (its saved weights loaded), only it trainable."""
    from peft import get_peft_model

    try:
        adapted = get_peft_model(model, lora_config(model_cfg))
    except ValueError as exc:  # PEFT's error when the names match no layer of the model
        raise ConfigError(f"{KEY}.target_modules", f"matches no layer LoRA can adapt in this model ({exc})") from exc
    return load_adapter(adapted, model_cfg)


def load_adapter(model: PeftModel, model_cfg: DictConfig) -> PeftModel:
    """``model`` (adapted with :func:`lora_config`) with the weights saved at ``lora_adapter_path``
    loaded into its adapter, when that key is set; every saved weight must land."""
    if not model_cfg.lora_adapter_path:
        return model
    from peft import load_peft_weights, set_peft_model_state_dict

    path = str(model_cfg.lora_adapter_path)
    loaded = set_peft_model_state_dict(model, load_peft_weights(path))
    if loaded.unexpected_keys:
        raise ConfigError(
            f"{KEY}.lora_adapter_path",
            f"the adapter at {path} holds weights this model has no place for: {sorted(loaded.unexpected_keys)[:3]}",
        )
    return model


@contextmanager
def base_policy(model: PeftModel) -> Iterator[torch.nn.Module]:
    """``model`` with its adapters disabled: the base model it was made from (the reference policy)."""
    with model.disable_adapter():
        yield model
