"""What the torch backend computes from its policy's logits: response log-probs, entropy, and the KL
estimate to the reference policy.

Logits are computed only where a response token is predicted (``logits_to_keep``): for padded rows
the last ``response_len + 1`` columns (:func:`response_distributions`), for rows packed with their
shared prefixes computed once the columns their
:class:`~agl_core.backends.torch.prefix_packing.PackedForward` keeps (:func:`packed_distributions`),
which each row then reads through the pass's ``index``.

Vision-language rows (:func:`agl_core.stages.tensorize.tensorize` with a ``VisionSpec``) carry
``position_ids`` as ``[rows, 4, L]`` (verl's layout: text positions, then mrope's temporal, height and
width ones), which the model takes as ``[4, rows, L]``, and their images under
:data:`MULTI_MODAL_INPUTS`: one dict per row, whose ``pixel_values`` and ``image_grid_thw`` the forward
concatenates in row order, the order their placeholder tokens have in the flattened batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from agl_core.backends.torch.prefix_packing import PackedForward

__all__ = [
    "MULTI_MODAL_INPUTS",
    "attention_implementation",
    "chosen_log_probs",
    "has_images",
    "low_var_kl",
    "model_attention_mask",
    "model_inputs",
    "packed_distributions",
    "per_row",
    "response_distributions",
    "response_log_probs",
    "token_entropy",
]


MULTI_MODAL_INPUTS = "multi_modal_inputs"
"""The batch entry (beside the tensors) holding each row's image inputs: a numpy object array of dicts,
``{}`` for a text row, else ``pixel_values`` and ``image_grid_thw``."""


def has_images(tensors: Mapping[str, Any]) -> bool:
    """Whether a row of the batch has images."""
    rows = tensors.get(MULTI_MODAL_INPUTS)
    return rows is not None and any(row for row in rows)


def model_inputs(tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The forward's inputs of a padded batch: ids, mask, positions (mrope ones as ``[4, rows, L]``)
    and its rows' images, concatenated in row order."""
    positions = tensors["position_ids"]
    inputs = {
        "input_ids": tensors["input_ids"],
        "attention_mask": tensors["attention_mask"],
        "position_ids": positions.transpose(0, 1) if positions.ndim == 3 else positions,
    }
    rows = [row for row in np.asarray(tensors.get(MULTI_MODAL_INPUTS, ())).tolist() if row]
    if rows:
        device = inputs["input_ids"].device
        for name in ("pixel_values", "image_grid_thw"):
            inputs[name] = torch.cat([torch.as_tensor(row[name]) for row in rows]).to(device)
    return inputs


def attention_implementation(model: torch.nn.Module) -> str | None:
    """The attention implementation of ``model``, or of the model a ``DistributedDataParallel`` wraps."""
    return getattr(getattr(model, "module", model).config, "_attn_implementation", None)


def model_attention_mask(model: torch.nn.Module, mask: torch.Tensor | None) -> torch.Tensor | None:
    """A 4-D boolean mask (True: attend) as the model's attention applies it. ``sdpa`` takes it as it
    is; ``eager`` adds its mask to the attention scores, so it gets 0 where a token attends and the
    lowest value of the model's dtype elsewhere (a boolean mask added to the scores masks nothing)."""
    if mask is None or attention_implementation(model) != "eager":
        return mask
    dtype = next(model.parameters()).dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def padded_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Padded rows' 4-D causal mask ``[rows, 1, L, L]`` in which a padding token attends to itself.
    Given the 2-D mask, transformers' eager attention leaves a left-padding token attending to nothing:
    its softmax in float64 is NaN, and the NaN reaches every real token through the zero weights."""
    valid = attention_mask.bool()
    length = valid.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    itself = torch.eye(length, dtype=torch.bool, device=valid.device)
    return ((causal & valid[:, None, :]) | itself)[:, None]


def response_distributions(model: torch.nn.Module, tensors: Mapping[str, Any]) -> torch.Tensor:
    """Log-softmax over the vocabulary at every response position, ``[rows, response_len, vocab]``, in
    float32 whatever dtype the model computes in."""
    width = tensors["responses"].shape[1]
    inputs = model_inputs(tensors)
    if attention_implementation(model) == "eager":
        inputs["attention_mask"] = model_attention_mask(model, padded_attention_mask(inputs["attention_mask"]))
    logits = model(**inputs, use_cache=False, logits_to_keep=width + 1).logits[:, :-1, :]
    return torch.log_softmax(logits.float(), dim=-1)


def packed_distributions(model: torch.nn.Module, packed: PackedForward) -> torch.Tensor:
    """Log-softmax over the vocabulary at the columns ``packed`` keeps of each of its packs,
    ``[packs × kept columns, vocab]`` (what ``packed.index`` points into), in float32."""
    logits = model(
        input_ids=packed.input_ids,
        attention_mask=model_attention_mask(model, packed.attention_mask),
        position_ids=packed.position_ids,
        use_cache=False,
        logits_to_keep=packed.keep,
    ).logits
    return torch.log_softmax(logits.flatten(0, 1).float(), dim=-1)


def per_row(values: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Per-position ``values`` as ``[rows, response_len]``: as they are (``index`` ``None``: already
    per row), or read through a packed pass's ``index``."""
    return values if index is None else values[index]


def chosen_log_probs(
    distributions: torch.Tensor, responses: torch.Tensor, index: torch.Tensor | None = None
) -> torch.Tensor:
    """The log-probs of the ``responses`` tokens, ``[rows, response_len]``, from
    :func:`response_distributions` (or :func:`packed_distributions` read through its ``index``)."""
    if index is None:
        return distributions.gather(-1, responses[..., None]).squeeze(-1)
    return distributions[index, responses]


def response_log_probs(
    model: torch.nn.Module, tensors: Mapping[str, Any], packed: PackedForward | None = None
) -> torch.Tensor:
    """Log-probs of the response tokens under ``model``, ``[rows, response_len]``: from the padded
    rows, or from ``packed`` (the same rows with their shared prefixes computed once)."""
    if packed is None:
        return chosen_log_probs(response_distributions(model, tensors), tensors["responses"])
    return chosen_log_probs(packed_distributions(model, packed), tensors["responses"], packed.index)


def token_entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """The policy's entropy at every position, from its log-softmax ``[..., vocab]``."""
    return -(log_probs.exp() * log_probs).sum(-1)


def low_var_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy ‖ reference) per token, clamped as verl does."""
    diff = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
    return torch.clamp(torch.exp(diff) - diff - 1, min=-10, max=10)
