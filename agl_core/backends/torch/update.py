"""The torch backend's actor update: AdamW with verl's lr schedules, PPO epochs over mini-batches.

Per mini-batch, the loss is the one verl's ``ppo_loss`` builds (:meth:`ActorUpdate.loss`): the
configured policy loss − ``actor.entropy_coeff`` × the entropy + ``actor.kl_loss_coef`` × the KL to
the initial policy (``actor.use_kl_loss``), the entropy and KL being token means over the
mini-batch (verl's ``agg_loss`` with its default ``token-mean``), whatever the policy loss's own
reduction. Then gradient clipping at ``actor.grad_clip`` → AdamW step, skipped and counted
(``actor/n_skipped_nonfinite_grad``) when the gradient norm is not finite.

Metrics, with verl's names: ``actor/pg_loss`` (the policy-loss term alone), ``actor/entropy_loss``
(reported every update, as verl does with Agent Lightning's ``calculate_entropy: true``),
``actor/kl_loss`` and ``actor/kl_coef`` (with the KL term), ``actor/loss`` (the total that is
minimised), the policy loss's own metrics, ``actor/grad_norm``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import torch

from agl_core.backends.torch.model_ops import chosen_log_probs, low_var_kl, response_distributions, response_log_probs, token_entropy
from agl_core.config import ConfigError
from agl_core.stages.pipeline import PreparedBatch
from agl_core.stages.policy_loss import LossSettings, PolicyLoss, batch_token_mean
from agl_core.stages.tensorize import tensorize

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["ActorSettings", "ActorUpdate", "UpdateBatch", "lr_lambda", "make_optimizer"]


def lr_lambda(optim: DictConfig, total_steps: int) -> Callable[[int], float]:
    """verl's schedules: linear warmup over ``lr_warmup_steps``, then constant or cosine down to
    ``min_lr_ratio``."""
    kind = optim.lr_scheduler_type
    if kind not in ("constant", "cosine"):
        raise ConfigError("actor_rollout_ref.actor.optim.lr_scheduler_type", f"must be constant or cosine, got {kind!r}")
    warmup = max(0, int(optim.lr_warmup_steps))
    floor = float(optim.min_lr_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def make_optimizer(model: torch.nn.Module, optim: DictConfig, total_steps: int) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW as ``actor_rollout_ref.actor.optim`` says, and its lr schedule over ``total_steps``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(optim.lr), betas=tuple(optim.betas), weight_decay=float(optim.weight_decay))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, total_steps))


@attrs.frozen
class ActorSettings:
    """The ``actor_rollout_ref.actor`` values one update reads."""

    ppo_epochs: int
    entropy_coeff: float
    kl_loss_coef: float
    grad_clip: float
    loss: LossSettings

    @classmethod
    def from_actor_config(cls, actor: DictConfig) -> ActorSettings:
        return cls(
            ppo_epochs=int(actor.ppo_epochs),
            entropy_coeff=float(actor.entropy_coeff),
            kl_loss_coef=float(actor.kl_loss_coef),
            grad_clip=float(actor.grad_clip),
            loss=LossSettings.from_actor_config(actor),
        )


@attrs.frozen
class UpdateBatch:
    """The tensors an update reads, row-aligned, so a mini-batch is the same slice of every one."""

    tensors: dict[str, torch.Tensor]
    advantages: torch.Tensor
    old_log_prob: torch.Tensor
    ref_log_prob: torch.Tensor | None

    @property
    def mask(self) -> torch.Tensor:
        return self.tensors["response_mask"]

    def rows(self, part: slice) -> UpdateBatch:
        return UpdateBatch(
            {k: v[part] for k, v in self.tensors.items()},
            self.advantages[part],
            self.old_log_prob[part],
            None if self.ref_log_prob is None else self.ref_log_prob[part],
        )


class ActorUpdate:
    """PPO epochs of ``loss_fn`` over a prepared batch's mini-batches, stepping ``optimizer``;
    ``ref_model`` (the initial policy, frozen) adds the KL term when given."""

    def __init__(
        self,
        model: torch.nn.Module,
        ref_model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        loss_fn: PolicyLoss,
        settings: ActorSettings,
        device: torch.device,
        pad_token_id: int,
    ):
        self.model, self.ref_model, self.optimizer = model, ref_model, optimizer
        self.loss_fn, self.settings = loss_fn, settings
        self.device, self.pad_token_id = device, pad_token_id

    def __call__(self, prepared: PreparedBatch) -> dict[str, float]:
        """Update on ``prepared`` (which has a shaped batch); the actor metrics, averaged over the
        mini-batch updates except the ``actor/n_*`` counts."""
        assert prepared.shaped is not None
        batch = self.batch(prepared)
        n_rows = len(prepared.shaped.rows)
        per_mini = n_rows // prepared.shaped.n_mini_batches
        sums: dict[str, float] = {}
        n_updates = 0
        for _ in range(self.settings.ppo_epochs):
            for start in range(0, n_rows, per_mini):
                for name, value in self.mini_batch_step(batch.rows(slice(start, start + per_mini))).items():
                    sums[name] = sums.get(name, 0.0) + float(value)
                n_updates += 1
        metrics = {k: v if k.startswith("actor/n_") else v / n_updates for k, v in sums.items()}
        metrics["actor/n_updates"] = float(n_updates)
        metrics["perf/total_num_tokens"] = float(int(batch.tensors["attention_mask"].sum()))
        return metrics

    def batch(self, prepared: PreparedBatch) -> UpdateBatch:
        """The prepared rows as tensors on the model's device, with the log-probs of the policy before the
        update (and of the reference policy)."""
        assert prepared.shaped is not None
        padded = tensorize(prepared.shaped.rows, pad_token_id=self.pad_token_id)
        tensors = {k: v.to(self.device) for k, v in padded.tensors.items()}
        with torch.no_grad():
            self.model.eval()
            old_log_prob = response_log_probs(self.model, tensors)
            ref_log_prob = response_log_probs(self.ref_model, tensors) if self.ref_model is not None else None
        self.model.train()
        return UpdateBatch(
            tensors,
            prepared.advantages(tensors["response_mask"].shape[1]).to(self.device),
            old_log_prob,
            ref_log_prob,
        )

    def mini_batch_step(self, mini: UpdateBatch) -> dict[str, float]:
        """One optimizer step on ``mini``; its metrics."""
        loss, metrics = self.loss(mini)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            metrics["actor/n_skipped_nonfinite_grad"] = 1.0
        return {**metrics, "actor/grad_norm": float(grad_norm)}

    def loss(self, mini: UpdateBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The policy loss on ``mini`` − the entropy bonus + the KL term (see the module docstring), and
        the metrics of every term."""
        distributions = response_distributions(self.model, mini.tensors)
        log_prob = chosen_log_probs(distributions, mini.tensors["responses"])
        pg_loss, pg_metrics = self.loss_fn(mini.old_log_prob, log_prob, mini.advantages, mini.mask, self.settings.loss)
        entropy = self.entropy_loss(distributions, mini.mask)
        loss = pg_loss - self.settings.entropy_coeff * entropy
        metrics = {**pg_metrics, "actor/pg_loss": pg_loss.item(), "actor/entropy_loss": entropy.item()}
        if mini.ref_log_prob is not None:
            kl = batch_token_mean(low_var_kl(log_prob, mini.ref_log_prob), mini.mask, self.settings.loss)
            loss = loss + self.settings.kl_loss_coef * kl
            metrics.update({"actor/kl_loss": kl.item(), "actor/kl_coef": self.settings.kl_loss_coef})
        metrics["actor/loss"] = loss.item()
        return loss, metrics

    def entropy_loss(self, distributions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The token-mean entropy, without a gradient when ``entropy_coeff`` is 0 (it is only reported)."""
        with torch.set_grad_enabled(self.settings.entropy_coeff > 0):
            return batch_token_mean(token_entropy(distributions), mask, self.settings.loss)
