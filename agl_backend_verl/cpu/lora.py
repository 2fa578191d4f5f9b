"""LoRA weights as the CPU replica serves them: adapters merged into the base weights.

With ``actor_rollout_ref.model.lora_rank`` > 0 (and ``lora.merge`` false, verl's default), verl's
weight sync sends the replica the base model once, under PEFT's names (``....base_layer.weight`` for
an adapted layer), then at every step only the adapters (``....lora_A.weight`` /
``....lora_B.weight``) with the adapter's PEFT config, as vLLM takes them to serve adapters. The
CPU replica serves one plain Hugging Face model instead, so it keeps the base weights and serves
``base + scale × B @ A`` per adapted layer (``scale`` = ``lora_alpha / r``, or ``/ sqrt(r)`` with
rsLoRA), the same weights PEFT's ``merge_and_unload`` gives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from agl_core import UsageError

__all__ = ["hf_name", "is_adapter", "lora_scale", "merge_adapters"]

_PREFIX = "base_model.model."


def hf_name(name: str) -> str:
    """A PEFT parameter name as the plain model names it (``base_model.model.`` and ``.base_layer`` dropped)."""
    name = name.removeprefix(_PREFIX)
    return name.replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_scale(peft_config: Any) -> float:
    """``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``) of a PEFT LoRA config (object or dict)."""
    get = (
        peft_config.get
        if isinstance(peft_config, Mapping)
        else lambda key, default=None: getattr(peft_config, key, default)
    )
    rank, alpha = int(get("r")), float(get("lora_alpha"))
    return alpha / math.sqrt(rank) if get("use_rslora", False) else alpha / rank


def merge_adapters(
    base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """The adapted layers' merged weights, by plain name: ``base[layer] + scale × B @ A`` for every
    ``lora_A`` / ``lora_B`` pair in ``adapters``. A pair without its base weight, or a lone half, is
    an error naming the layer."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        plain = hf_name(name)
        for half in ("lora_A", "lora_B"):
            marker = f".{half}."
            if marker in plain:
                layer = plain.split(marker)[0]
                halves.setdefault(layer, {})[half] = tensor
    merged = {}
    for layer, pair in halves.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise UsageError(f"LoRA layer {layer!r} came with {sorted(pair)} only")
        weight = f"{layer}.weight"
        if weight not in base:
            raise UsageError(f"LoRA layer {layer!r} has no base weight {weight!r} in the served model")
        delta = pair["lora_B"].float() @ pair["lora_A"].float()
        merged[weight] = (base[weight].float() + scale * delta).to(base[weight].dtype)
    return merged
