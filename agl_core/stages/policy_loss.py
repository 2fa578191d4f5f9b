"""What every policy loss shares: the signature, its settings and the per-token PPO term.

Every loss has the signature::

    loss_fn(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None)
        -> (loss, metrics)

over ``[batch, response_len]`` torch tensors (``response_mask`` bool or 0/1; padded positions may
hold anything, even NaN: they are excluded by ``torch.where`` so no value or gradient leaks).
``settings`` is a :class:`LossSettings`; ``metrics`` maps ``actor/pg_clipfrac``, ``actor/ppo_kl``
and ``actor/pg_clipfrac_lower`` to Python floats. Both built-ins share the per-token PPO term
(:func:`ppo_token_losses`), with ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``:

    l = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    l = min(l, -A * clip_ratio_c)   where A < 0   (dual clip)
    l = l * w                       with importance weights w = rollout_is_weights, if given

and differ only in how they reduce it over the trained tokens ``T`` of the (micro-)batch:

* ``token_mean``: ``loss = sum_T l / n_tokens * dp_size`` (:func:`batch_token_mean`), where
  ``n_tokens`` is ``settings.batch_num_tokens`` (the mini-batch's trained tokens over all
  data-parallel ranks) or, when unset, the trained tokens of these tensors. This is verl's
  ``vanilla`` loss with ``token-mean`` aggregation.
* ``per_rollout_mean``: ``loss = sum_T l * dp_size``. The advantages must already be scaled per
  rollout (:func:`agl_core.stages.normalization.rollout_scales`, applied by the step pipeline), which
  makes this sum a mean over rollouts; multiplying by ``dp_size`` undoes the data-parallel gradient averaging.

``cispo_per_rollout_mean`` (Agent Lightning 1.0.2's CISPO loss) reduces as ``per_rollout_mean`` does
but replaces the per-token term (:func:`cispo_token_losses`): the clipped ratio is a constant weight
on the log-prob, so a token whose ratio is past a bound still gets a gradient (of the clipped size)::

    l = -sg(clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A * log_prob * w

with ``sg`` the stop-gradient; ``clip_ratio_c`` plays no part.

Mapping onto verl 0.9.1: verl's policy-loss registry (``verl.trainer.ppo.core_algos.
register_policy_loss(name)``, looked up by ``get_policy_loss_fn(actor.policy_loss.loss_mode)``)
calls ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights)`` with ``config`` verl's ``ActorConfig`` (``clip_ratio``, ``clip_ratio_low``,
``clip_ratio_high``, ``clip_ratio_c`` and ``global_batch_info`` = ``{dp_size, batch_num_tokens,
global_batch_size, loss_scale_factor}``), and expects ``(loss, metrics)`` with the metrics above.
:func:`agl_backend_verl.policy_loss.as_verl_policy_loss` is the adapter: it builds :class:`LossSettings`
from ``config`` with :meth:`LossSettings.from_actor_config` and drops ``loss_agg_mode`` (each of our
losses fixes its own reduction).

What a loss needs from the step pipeline is declared when it is registered, with a
:class:`PolicyLossSpec`: ``register("per_rollout_mean", PolicyLossSpec(per_rollout_mean,
scale_advantages_per_rollout=True))``. ``register(name, fn)`` with a plain function is
``PolicyLossSpec(fn)``: raw advantages, additive over micro-batches. Both backends read the
declaration (:func:`policy_loss_spec`), never the loss's name, so a wrapper registered under a new
name gets scaled advantages exactly when it declares so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import attrs

from agl_core.errors import UsageError, UsageTypeError

if TYPE_CHECKING:  # torch is imported when a loss runs, so registering one (agl plugins) does not load it
    import torch

__all__ = [
    "LossSettings",
    "PolicyLoss",
    "PolicyLossSpec",
    "batch_token_mean",
    "cispo_token_losses",
    "masked_sum",
    "policy_loss_spec",
    "ppo_token_losses",
]


class PolicyLoss(Protocol):
    """What ``agl_register_policy_losses`` registers (bare, or inside a :class:`PolicyLossSpec`):
    ``(loss, metrics)`` of a padded ``[batch, response_len]`` batch, padded positions excluded."""

    __module__ = "agl_core"

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        settings: LossSettings,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


def _callable(_instance: Any, _attribute: Any, value: Any) -> None:
    if not callable(value):
        raise UsageTypeError(f"PolicyLossSpec.fn must be a policy-loss function, got {value!r}")


@attrs.frozen
class PolicyLossSpec:
    """A policy loss and what it needs from the step pipeline; calling it calls ``fn``.

    ``scale_advantages_per_rollout``: the pipeline multiplies each row's advantages by its
    per-rollout scale (``agentlightning.loss_normalization``, see
    :mod:`agl_core.stages.normalization`) before the loss sees them, and the loss sums its per-token
    terms; the entropy bonus is weighted the same way. ``additive_over_micro_batches``: given the
    mini-batch's ``settings`` (``batch_num_tokens``), the losses of any split of a mini-batch into
    micro-batches add up to the loss of the whole mini-batch, so gradient accumulation does not
    depend on the micro-batch size; the loss contract checks it unless a loss declares ``False``.
    """

    fn: PolicyLoss = attrs.field(validator=_callable)
    scale_advantages_per_rollout: bool = False
    additive_over_micro_batches: bool = True

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return self.fn(*args, **kwargs)


def policy_loss_spec(loss: PolicyLoss | PolicyLossSpec) -> PolicyLossSpec:
    """The declaration of a registered loss: ``loss`` itself, or ``PolicyLossSpec(loss)`` for a plain function."""
    return loss if isinstance(loss, PolicyLossSpec) else PolicyLossSpec(loss)


def _config_get(config: Any, name: str, default: Any) -> Any:
    if hasattr(config, "get"):
        return config.get(name, default)
    return getattr(config, name, default)


@attrs.frozen
class LossSettings:
    """The actor settings a loss reads (``actor_rollout_ref.actor.*``, verl's names and defaults).

    ``clip_ratio_low`` / ``clip_ratio_high`` default to ``clip_ratio``; ``clip_ratio_c`` (> 1) is the
    dual-clip bound for negative advantages (the config schema checks the values). ``dp_size`` is the
    data-parallel world size and ``batch_num_tokens`` the trained tokens of the whole mini-batch
    across ranks (``token_mean``).
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    dp_size: int = 1
    batch_num_tokens: int | None = None

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @classmethod
    def from_actor_config(cls, config: Any) -> LossSettings:
        """From an actor config: agl's ``actor_rollout_ref.actor`` node or verl's ``ActorConfig``."""
        batch_info = _config_get(config, "global_batch_info", None) or {}
        batch_num_tokens = batch_info.get("batch_num_tokens")
        return cls(
            clip_ratio=float(_config_get(config, "clip_ratio", 0.2)),
            clip_ratio_low=_config_get(config, "clip_ratio_low", None),
            clip_ratio_high=_config_get(config, "clip_ratio_high", None),
            clip_ratio_c=float(_config_get(config, "clip_ratio_c", 3.0)),
            dp_size=int(batch_info.get("dp_size") or 1),
            batch_num_tokens=None if batch_num_tokens is None else int(batch_num_tokens),
        )


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.where(mask, values, torch.zeros_like(values)).sum()


def batch_token_mean(values: torch.Tensor, response_mask: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    """``sum_T values / n_tokens * dp_size``: verl's ``agg_loss`` with ``token-mean``.

    ``n_tokens`` is ``settings.batch_num_tokens`` (the mini-batch's trained tokens over every rank and
    micro-batch) or, when unset, the trained tokens of these tensors; so the parts of a mini-batch,
    split over micro-batches or data-parallel ranks, add up to the mean over the whole mini-batch.
    """
    mask = response_mask.bool()
    n_tokens = settings.batch_num_tokens
    if n_tokens is None:
        if settings.dp_size > 1:
            raise UsageError("a token mean needs settings.batch_num_tokens (the global token count) when dp_size > 1")
        n_tokens = mask.sum()
    return masked_sum(values, mask) / n_tokens * settings.dp_size


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(values, mask) / (mask.sum() + 1e-8)


def ppo_token_losses(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: LossSettings,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token dual-clip PPO loss ``l`` (see the module docstring) and its metrics.

    ``actor/ppo_kl`` is the mean of ``old_log_prob - log_prob`` over trained tokens;
    ``actor/pg_clipfrac`` the fraction of trained tokens where the clipped term wins;
    ``actor/pg_clipfrac_lower`` the fraction where the dual clip wins (negative advantages).
    """
    import torch

    mask = response_mask.bool()
    # Padded positions are zeroed before any arithmetic so a NaN there reaches neither value nor gradient.
    log_ratio = torch.clamp(torch.where(mask, log_prob - old_log_prob, 0.0), min=-20.0, max=20.0)
    advantages = torch.where(mask, advantages, 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - settings.low, 1.0 + settings.high)
    ppo = torch.maximum(unclipped, clipped)
    dual = -advantages * settings.clip_ratio_c
    negative = advantages < 0
    losses = torch.where(negative, torch.minimum(ppo, dual), ppo)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    metrics = {
        "actor/pg_clipfrac": _masked_mean((clipped > unclipped).to(log_prob.dtype), mask).item(),
        "actor/ppo_kl": _masked_mean(-log_ratio, mask).detach().item(),
        "actor/pg_clipfrac_lower": _masked_mean(((ppo > dual) & negative).to(log_prob.dtype), mask).item(),
    }
    return losses, metrics


def cispo_token_losses(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: LossSettings,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO's per-token loss ``l`` (see the module docstring) and its metrics.

    ``actor/pg_clipfrac`` is the fraction of trained tokens whose ratio the clip changes;
    ``actor/pg_clipfrac_lower`` is 0 (there is no dual clip); ``actor/ppo_kl`` as for PPO.
    """
    import torch

    mask = response_mask.bool()
    log_ratio = torch.clamp(torch.where(mask, log_prob - old_log_prob, 0.0), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - settings.low, 1.0 + settings.high).detach()
    losses = -weight * torch.where(mask, advantages, 0.0) * torch.where(mask, log_prob, 0.0)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    metrics = {
        "actor/pg_clipfrac": _masked_mean((weight != ratio).to(log_prob.dtype), mask).item(),
        "actor/ppo_kl": _masked_mean(-log_ratio, mask).detach().item(),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return losses, metrics
