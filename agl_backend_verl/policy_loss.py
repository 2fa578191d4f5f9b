"""agl's policy losses with verl's policy-loss signature, for ``verl.trainer.ppo.core_algos.register_policy_loss``.

verl calls ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights)`` with ``config`` its ``ActorConfig``; an agl loss takes :class:`agl_core.LossSettings`
instead and fixes its own reduction, so the adapter builds the settings from ``config`` and drops
``loss_agg_mode``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agl_core import LossSettings, PolicyLoss, PolicyLossSpec, UsageError, policy_loss_spec

__all__ = ["as_verl_policy_loss"]


def as_verl_policy_loss(loss: PolicyLoss | PolicyLossSpec) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """``loss`` (a function or a :class:`PolicyLossSpec`) with verl's policy-loss signature, ready
    for ``register_policy_loss(name)``."""
    loss_fn = policy_loss_spec(loss).fn
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)

    def verl_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if config is None:
            raise UsageError(f"policy loss {name!r} needs the actor config")
        settings = LossSettings.from_actor_config(config)
        return loss_fn(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights)

    verl_policy_loss.__name__ = name
    verl_policy_loss.__doc__ = loss_fn.__doc__
    return verl_policy_loss
