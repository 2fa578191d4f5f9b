"""The policy's model from its folder, for every process that loads it (the torch backend's trainer,
verl's CPU replica that serves it): a causal LM, or a vision-language model when the folder holds an
image processor (Qwen2-VL's family, whose class ``AutoModelForCausalLM`` does not load)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["IMAGE_PROCESSOR_FILE", "is_vision_policy", "load_policy_model"]

IMAGE_PROCESSOR_FILE = "preprocessor_config.json"


def is_vision_policy(folder: str | os.PathLike[str]) -> bool:
    """Whether the model folder holds a vision-language policy: it has an image processor."""
    return (Path(folder) / IMAGE_PROCESSOR_FILE).is_file()


def load_policy_model(
    folder: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, **options: Any
) -> torch.nn.Module:
    """The model in ``folder`` in ``dtype`` (on the CPU), with ``options`` for ``from_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision_policy(folder) else AutoModelForCausalLM
    return auto.from_pretrained(folder, dtype=dtype, **options)
