"""What an engine serves for a trainer's policy: the model itself or, for a PEFT (LoRA) model, its base
model with the adapters merged in.

The merged weights are computed aside (base weight + the adapter's delta, in the base weight's dtype):
the trainer's module is never merged and unmerged in place, so its base weights stay bit-for-bit what
they were, and its reference policy (the base, adapters disabled) with them.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

__all__ = ["is_adapted", "save_served", "served_copy", "served_state_dict"]

BASE_LAYER = "base_layer."


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (peft is only imported by code that made one)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def served_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights to serve, under the plain model's names: ``model.state_dict()``, or for a PEFT
    model its base model's weights with every active LoRA adapter merged in."""
    if not is_adapted(model):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in base.state_dict().items():
            owner = _adapted_owner(key, layers)
            if owner is None:
                out[key] = value
                continue
            rest = key[len(owner) + 1 :]
            if not rest.startswith(BASE_LAYER):
                continue  # the adapter's own weights (lora_A, lora_B): merged into the base weight below
            key = f"{owner}.{rest[len(BASE_LAYER) :]}"
            if key == f"{owner}.weight":
                layer = layers[owner]
                value = value + sum(layer.get_delta_weight(adapter) for adapter in layer.active_adapters).to(
                    value.dtype
                )
            out[key] = value
    return out


def _adapted_owner(key: str, layers: dict[str, torch.nn.Module]) -> str | None:
    """The LoRA layer whose weight ``key`` is (or is part of), if any."""
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in layers:
            return prefix
    return None


def served_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain module with ``model``'s architecture to serve from (a PEFT model's copy merged and
    unloaded), in eval mode; :func:`served_state_dict` fills it."""
    copied = copy.deepcopy(model)
    if is_adapted(copied):
        copied = copied.merge_and_unload()
    return copied.eval()


def save_served(model: torch.nn.Module, folder: str | os.PathLike[str]) -> None:
    """Write what :func:`served_state_dict` serves as a Hugging Face model folder (config and safetensors)."""
    if is_adapted(model):
        model.get_base_model().save_pretrained(folder, state_dict=served_state_dict(model))
    else:
        model.save_pretrained(folder)
