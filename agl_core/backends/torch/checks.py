"""What ``agl check`` verifies of a ``torch`` backend run without loading the model, and without
importing torch unless the device asks for CUDA: the model folder, the device, LoRA's keys, the
dtypes and, for the embedded source, that the agent class imports. ``TorchBackend`` runs the same
checks when it starts (``model_folder``, ``check_device``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from agl_core.backends.lora import check_lora_keys
from agl_core.backends.precision import dtype_names
from agl_core.backends.rollout_source import check_rollout_source
from agl_core.config import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["check_device", "check_torch_config", "model_folder"]


def model_folder(config: DictConfig) -> Path:
    """The policy's folder (``actor_rollout_ref.model.path``), which must hold a ``config.json``."""
    path = config.actor_rollout_ref.model.path
    key = "actor_rollout_ref.model.path"
    if not path:
        raise ConfigError(key, "the policy's model folder is not set")
    folder = Path(path)
    if not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "has no config.json"
        raise ConfigError(key, f"model folder {path} {what} (a local Hugging Face causal LM folder is needed)")
    return folder


def check_device(name: str) -> None:
    """``cuda`` and ``cuda:N`` need a CUDA device (torch is imported to ask); ``auto`` and ``cpu`` always work."""
    if name.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("agentlightning.torch.device", f"{name} was asked for, but no CUDA device is available")


def check_torch_config(config: DictConfig) -> None:
    """The ``check_config`` of the ``torch`` backend's :class:`~agl_core.BackendSpec` (see the module docstring)."""
    model_folder(config)
    check_device(config.agentlightning.torch.device)
    check_lora_keys(config.actor_rollout_ref.model)
    dtype_names(config.actor_rollout_ref.actor.fsdp_config)
    check_rollout_source(config)
