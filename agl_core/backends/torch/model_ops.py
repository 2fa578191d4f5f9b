"""What the torch backend computes from its policy's logits: response log-probs, entropy, and the KL
estimate to the reference policy."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["chosen_log_probs", "low_var_kl", "response_distributions", "response_log_probs", "token_entropy"]


def response_distributions(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Log-softmax over the vocabulary at every response position, ``[rows, response_len, vocab]``, in
    float32 whatever dtype the model computes in."""
    width = tensors["responses"].shape[1]
    logits = model(
        input_ids=tensors["input_ids"],
        attention_mask=tensors["attention_mask"],
        position_ids=tensors["position_ids"],
        use_cache=False,
    ).logits[:, -width - 1 : -1, :]
    return torch.log_softmax(logits.float(), dim=-1)


def chosen_log_probs(distributions: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """The log-probs of the ``responses`` tokens, ``[rows, response_len]``, from :func:`response_distributions`."""
    return distributions.gather(-1, responses[..., None]).squeeze(-1)


def response_log_probs(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Log-probs of the response tokens under ``model``, ``[rows, response_len]``."""
    return chosen_log_probs(response_distributions(model, tensors), tensors["responses"])


def token_entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """The policy's entropy at every position, from its log-softmax ``[..., vocab]``."""
    return -(log_probs.exp() * log_probs).sum(-1)


def low_var_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy ‖ reference) per token, clamped as verl does."""
    diff = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
    return torch.clamp(torch.exp(diff) - diff - 1, min=-10, max=10)
