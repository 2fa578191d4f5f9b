"""The built-in policy losses, ``token_mean``, ``per_rollout_mean`` and ``cispo_per_rollout_mean``,
registered as an ordinary plugin.

The first two reduce the same per-token PPO term (:func:`agl_core.stages.policy_loss.ppo_token_losses`);
``cispo_per_rollout_mean`` reduces CISPO's term (:func:`~agl_core.stages.policy_loss.cispo_token_losses`)
as ``per_rollout_mean`` does. See :mod:`agl_core.stages.policy_loss` for the formulas and the mapping
onto verl's registry. The per-rollout losses are registered with a
:class:`~agl_core.stages.policy_loss.PolicyLossSpec` declaring that they need their advantages scaled
per rollout; ``token_mean`` as a plain function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agl_core.hookspecs import hookimpl
from agl_core.stages.policy_loss import (
    LossSettings,
    PolicyLossSpec,
    batch_token_mean,
    cispo_token_losses,
    masked_sum,
    ppo_token_losses,
)

if TYPE_CHECKING:
    import torch

__all__ = ["cispo_per_rollout_mean", "per_rollout_mean", "token_mean"]


def token_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: LossSettings,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum_T l / n_tokens * dp_size``: the plain PPO loss averaged over trained tokens."""
    losses, metrics = ppo_token_losses(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights)
    return batch_token_mean(losses, response_mask, settings), metrics


def per_rollout_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: LossSettings,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum_T l * dp_size`` over advantages already scaled per rollout (a mean over rollouts)."""
    losses, metrics = ppo_token_losses(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights)
    return masked_sum(losses, response_mask.bool()) * settings.dp_size, metrics


def cispo_per_rollout_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: LossSettings,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO's ``sum_T l * dp_size`` over advantages already scaled per rollout: clipped tokens
    keep a gradient, weighted by their clipped ratio."""
    losses, metrics = cispo_token_losses(
        old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights
    )
    return masked_sum(losses, response_mask.bool()) * settings.dp_size, metrics


@hookimpl
def agl_register_policy_losses(register: Any) -> None:
    register("per_rollout_mean", PolicyLossSpec(per_rollout_mean, scale_advantages_per_rollout=True))
    register("cispo_per_rollout_mean", PolicyLossSpec(cispo_per_rollout_mean, scale_advantages_per_rollout=True))
    register("token_mean", token_mean)
