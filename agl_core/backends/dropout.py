"""Dropout off in every update forward (``agentlightning.disable_dropout``, on by default).

A backend takes the old log-probs with the policy in eval mode and runs the update's forward in train
mode. With dropout on, the two passes compute different functions: the first mini-batch's ratio is
not 1, and the clipping acts on noise (TRL's ``disable_dropout``, which agl turns on by default).

Hugging Face models read their dropout probabilities from the config when they are built, and many
keep them as plain numbers (``self.attention_dropout = config.attention_dropout``), so the config's
probabilities are zeroed before the model is built (:func:`dropout_overrides`: the same mapping is
verl's ``override_config``). A dropout layer the model builds with a probability of its own is then
found by building the model on the meta device (:func:`check_no_dropout_layers`), and a model loaded
here is run once in each mode (:func:`check_train_mode_exact`): what still differs is refused naming
the key, rather than trained as if it did not.
"""

from __future__ import annotations

import copy
import os
import re
from typing import TYPE_CHECKING, Any

from agl_core.config import ConfigError
from agl_core.fields import is_number

if TYPE_CHECKING:  # torch is imported where a model is built: the key's name is read by config checks
    import torch
    from transformers import PretrainedConfig

__all__ = [
    "DISABLE_DROPOUT",
    "check_no_dropout_layers",
    "check_train_mode_exact",
    "dropout_overrides",
    "load_update_model",
]

DISABLE_DROPOUT = "agentlightning.disable_dropout"
"""The key (bool, default true) whose refusals these checks name."""

# The names Hugging Face configs give the probabilities of what a model only does while training:
# dropout (``dropout``, ``attention_dropout``, ``hidden_dropout_prob``, GPT-2's ``resid_pdrop``...),
# layer drop (``layerdrop``, ``encoder_layerdrop``) and stochastic depth (``drop_path_rate``).
_PROBABILITY = re.compile(r"dropout|pdrop|layerdrop|drop_path|drop_prob|drop_rate")

# The train-mode forward may differ from the eval-mode one by this much, relative to the largest logit:
# the same computation run twice; dropout of any probability is orders of magnitude above it.
_TOLERANCE = 1e-4


def dropout_overrides(config: PretrainedConfig) -> dict[str, Any]:
    """The non-zero dropout probabilities of ``config`` and of its sub-configs (a vision-language
    model's ``text_config``, ``vision_config``), each set to 0, as a nested mapping for
    ``from_pretrained``'s config or verl's ``override_config``."""
    from transformers import PretrainedConfig

    overrides: dict[str, Any] = {}
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            if nested := dropout_overrides(value):
                overrides[name] = nested
        elif _PROBABILITY.search(name) and is_number(value) and value > 0:
            overrides[name] = 0.0
    return overrides


def _apply(config: PretrainedConfig, overrides: dict[str, Any]) -> None:
    for name, value in overrides.items():
        if isinstance(value, dict):
            _apply(getattr(config, name), value)
        else:
            setattr(config, name, value)


def check_no_dropout_layers(config: PretrainedConfig, where: str) -> None:
    """Refuse, naming :data:`DISABLE_DROPOUT`, a model that ``config`` with its probabilities zeroed
    (:func:`dropout_overrides`) still builds with a dropout layer of non-zero probability: built on the
    meta device, no weight is read. ``where`` names the model (its folder) in the message."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = copy.deepcopy(config)
    _apply(config, dropout_overrides(config))
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    _refuse_dropout_layers(model, where)


def _refuse_dropout_layers(model: torch.nn.Module, where: str) -> None:
    from torch import nn

    layers = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
    left = sorted(n for n, module in model.named_modules() if isinstance(module, layers) and module.p > 0)
    if left:
        raise ConfigError(
            DISABLE_DROPOUT,
            f"the model in {where} has dropout its config does not set ({', '.join(left[:3])}"
            f"{', ...' if len(left) > 3 else ''}), which cannot be turned off; "
            f"set {DISABLE_DROPOUT}=false to train with dropout",
        )


def check_train_mode_exact(model: torch.nn.Module, where: str) -> None:
    """Refuse, naming :data:`DISABLE_DROPOUT`, a model whose forward in train mode differs from its
    forward in eval mode on a few tokens (randomness left that the config does not name); the model's
    mode is restored."""
    import torch

    parameter = next(model.parameters())
    config = model.config.get_text_config()
    ids = (torch.arange(8, device=parameter.device) % int(config.vocab_size))[None]
    training = model.training
    try:
        with torch.no_grad():
            logits = [model.train(mode)(input_ids=ids, use_cache=False).logits.float() for mode in (False, True)]
    finally:
        model.train(training)
    difference = float((logits[0] - logits[1]).abs().max())
    if not difference <= _TOLERANCE * (1.0 + float(logits[0].abs().max())):
        raise ConfigError(
            DISABLE_DROPOUT,
            f"the model in {where} computes differently in train mode with its dropout off (logits differ "
            f"by {difference:.3g}): it has training-time randomness that cannot be turned off; "
            f"set {DISABLE_DROPOUT}=false to train with it",
        )


def load_update_model(
    folder: str | os.PathLike[str],
    *,
    disable_dropout: bool,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> torch.nn.Module:
    """The policy in ``folder`` to train (:func:`~agl_core.serving.models.load_policy_model`), in
    ``dtype`` (float32 by default) on ``device``, with its dropout off when ``disable_dropout``: its
    config's probabilities zeroed before it is built, and checked to compute in train mode what it
    computes in eval mode."""
    import torch

    from agl_core.serving.models import load_policy_model

    dtype = torch.float32 if dtype is None else dtype
    if not disable_dropout:
        return load_policy_model(folder, dtype=dtype).to(device)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    _apply(config, dropout_overrides(config))
    model = load_policy_model(folder, dtype=dtype, config=config).to(device)
    _refuse_dropout_layers(model, str(folder))
    check_train_mode_exact(model, str(folder))
    return model
