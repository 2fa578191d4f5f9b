"""``agentlightning.disable_dropout`` on verl: dropout off in the actor's (and the critic's) update.

verl builds each model from its Hugging Face config updated by the section's ``override_config``
(``actor_rollout_ref.model.override_config``, or its ``model_config`` entry when the user nests it
there), so the model's dropout probabilities go there as zeros
(:func:`agl_core.backends.dropout.dropout_overrides`). A probability the user sets there above 0
contradicts the key and is refused naming both; a model that would still build a dropout layer is
refused (:func:`agl_core.backends.dropout.check_no_dropout_layers`).

The model's config is read where verl reads it: in the task runner, a hub id is resolved as verl
resolves it. Before Ray starts (``agl check``, and ``agl train`` before the run) it is read only from
this machine (a folder, or the hub's cache): a hub id not cached here is checked in the task runner.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from agl_backend_verl.config import uses_critic
from agl_core import ConfigError
from agl_core.backends.dropout import DISABLE_DROPOUT, check_no_dropout_layers, dropout_overrides

__all__ = ["dropout_override_configs", "turn_off_dropout"]

logger = logging.getLogger(__name__)


def _target(section: str, model: DictConfig) -> tuple[str, Any]:
    """The key of the mapping verl updates the section's model config with, and its value."""
    override = model.get("override_config") or {}
    if "model_config" in override:
        return f"{section}.override_config.model_config", override["model_config"]
    return f"{section}.override_config", override


def _conflicts(key: str, overrides: dict[str, Any], user: Any) -> None:
    for name, zero in overrides.items():
        value = user.get(name) if user is not None else None
        if isinstance(zero, dict):
            _conflicts(f"{key}.{name}", zero, value)
        elif value is not None and value != 0:
            raise ConfigError(
                f"{key}.{name}",
                f"is {value}, but {DISABLE_DROPOUT}=true turns the model's dropout off: set "
                f"{DISABLE_DROPOUT}=false to train with dropout, or remove {key}.{name}",
            )


def dropout_override_configs(cfg: DictConfig, *, local_files_only: bool = False) -> dict[str, dict[str, Any]]:
    """With ``agentlightning.disable_dropout``, the key of each trained model's override mapping
    (the actor's, and the critic's when it is used) -> the zeroed probabilities it needs; what the
    user's overrides contradict, or what cannot be turned off, refused by key. With
    ``local_files_only`` (before Ray starts) a model whose config is not on this machine is left to
    the task runner's check."""
    if not cfg.agentlightning.disable_dropout:
        return {}
    from transformers import AutoConfig

    sections = ["actor_rollout_ref.model"] + (["critic.model"] if uses_critic(cfg) else [])
    wanted = {}
    for section in sections:
        model = OmegaConf.select(cfg, section)
        try:
            config = AutoConfig.from_pretrained(str(model.path), local_files_only=local_files_only)
        except (OSError, ValueError) as exc:
            if local_files_only:
                where = (section, model.path)
                logger.info("%s.path %s is not on this machine: its dropout is checked where verl loads it", *where)
                continue
            raise ConfigError(
                f"{section}.path",
                f"its config cannot be read to turn the model's dropout off ({exc}); set {DISABLE_DROPOUT}=false "
                "to train without reading it",
            ) from None
        key, user = _target(section, model)
        overrides = dropout_overrides(config)
        _conflicts(key, overrides, user)
        check_no_dropout_layers(config, str(model.path))
        if overrides:
            wanted[key] = overrides
    return wanted


def turn_off_dropout(cfg: DictConfig) -> None:
    """Merge :func:`dropout_override_configs` into ``cfg``'s override mappings, the user's entries kept."""
    for key, overrides in dropout_override_configs(cfg).items():
        with open_dict(cfg):
            user = OmegaConf.select(cfg, key) or {}
            OmegaConf.update(cfg, key, OmegaConf.merge(overrides, user), merge=False)
