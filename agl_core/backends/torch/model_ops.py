"""What the torch backend computes from its policy's logits: response log-probs, entropy, and the KL
estimate to the reference policy.

Logits are computed only where a response token is predicted (``logits_to_keep``): for padded rows
the last ``response_len + 1`` columns (:func:`response_distributions`), for rows packed with their
shared prefixes computed once the columns their
:class:`~agl_core.backends.torch.prefix_packing.PackedForward` keeps (:func:`packed_distributions`),
which each row then reads through the pass's ``index``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from agl_core.backends.torch.prefix_packing import PackedForward

__all__ = [
    "chosen_log_probs",
    "low_var_kl",
    "packed_distributions",
    "per_row",
    "response_distributions",
    "response_log_probs",
    "token_entropy",
]


def response_distributions(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Log-softmax over the vocabulary at every response position, ``[rows, response_len, vocab]``, in
    float32 whatever dtype the model computes in."""
    width = tensors["responses"].shape[1]
    logits = model(
        input_ids=tensors["input_ids"],
        attention_mask=tensors["attention_mask"],
        position_ids=tensors["position_ids"],
        use_cache=False,
        logits_to_keep=width + 1,
    ).logits[:, :-1, :]
    return torch.log_softmax(logits.float(), dim=-1)


def packed_distributions(model: torch.nn.Module, packed: PackedForward) -> torch.Tensor:
    """Log-softmax over the vocabulary at the columns ``packed`` keeps of each of its packs,
    ``[packs × kept columns, vocab]`` (what ``packed.index`` points into), in float32."""
    logits = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
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
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], packed: PackedForward | None = None
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
