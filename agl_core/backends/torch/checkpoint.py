"""The reference backend's files in a checkpoint folder (:mod:`agl_core.backends.checkpoints`): the policy.

``model/`` holds the policy and tokenizer, loadable by any Hugging Face tool or inference server; in
a LoRA run ``adapter/`` holds the PEFT adapter and tokenizer alone instead (loadable with PEFT or as
``actor_rollout_ref.model.lora_adapter_path``; the base weights never change). The optimizer, the
lr scheduler and the serving engine's sampler state go into the folder's ``trainer_state.pt`` with
the step loop's state (:meth:`~agl_core.backends.torch.backend.TorchBackend.save_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agl_core.config import ConfigError
from agl_core.serving.weights import is_adapted

__all__ = ["ADAPTER_DIR", "MODEL_DIR", "load_weights", "save_weights"]

MODEL_DIR = "model"
ADAPTER_DIR = "adapter"  # a LoRA run's checkpoints hold the adapter only
KEY = "trainer.default_local_dir"  # where the checkpoints are: errors about them name it


def save_weights(folder: str | Path, model: Any, tokenizer: Any) -> None:
    """Write the policy (a LoRA model: its adapter) and the tokenizer into checkpoint ``folder``."""
    weights = Path(folder) / (ADAPTER_DIR if is_adapted(model) else MODEL_DIR)
    model.save_pretrained(weights)
    tokenizer.save_pretrained(weights)


def load_weights(folder: str | Path, model: torch.nn.Module) -> None:
    """Load the weights of checkpoint ``folder`` into ``model`` (a LoRA model: its adapter)."""
    from safetensors.torch import load_file

    path = Path(folder)
    adapted, has_adapter = is_adapted(model), (path / ADAPTER_DIR).is_dir()
    if adapted != has_adapter:
        held, runs = ("a LoRA adapter", "without LoRA") if has_adapter else ("a full model", "with LoRA")
        raise ConfigError(
            "actor_rollout_ref.model.lora_rank", f"checkpoint {path} holds {held}, but this run trains {runs}"
        )
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((path / (ADAPTER_DIR if adapted else MODEL_DIR)).glob("*.safetensors")):
        weights.update(load_file(shard))
    if adapted:
        _load_adapter(path, model, weights)
        return
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {name for name in missing if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in name}
    if set(missing) - tied or unexpected:
        raise ConfigError(
            KEY,
            f"checkpoint {path} does not fit the model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}",
        )


def _load_adapter(path: Path, model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Set a PEFT model's adapter weights from a checkpoint's, which must be exactly its own."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = set(get_peft_model_state_dict(model))
    if set(weights) != expected:
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ConfigError(
            KEY, f"checkpoint {path} does not fit the adapter: missing {missing}, unexpected {unexpected}"
        )
    set_peft_model_state_dict(model, weights)
