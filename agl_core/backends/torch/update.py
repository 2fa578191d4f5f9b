"""The torch backend's actor update: AdamW with verl's lr schedules, PPO epochs over mini-batches,
each step composed of the update toolkit's parts (:mod:`agl_core.backends.ppo`).

Per mini-batch, the loss is the one verl's ``ppo_loss`` builds (:meth:`ActorUpdate.loss`): the
configured policy loss − ``actor.entropy_coeff`` × the entropy + ``actor.kl_loss_coef`` × the KL to
the initial policy (``actor.use_kl_loss``), the entropy and KL being token means over the
mini-batch (verl's ``agg_loss`` with its default ``token-mean``), whatever the policy loss's own
reduction. Then gradient clipping at ``actor.grad_clip`` → AdamW step, skipped and counted
(``actor/n_skipped_nonfinite_grad``) when the gradient norm is not finite.

Token-budget micro-batches (verl's keys, :mod:`agl_core.backends.micro_batching`): with
``actor.use_dynamic_bsz`` each mini-batch's gradients are accumulated over micro-batches of at most
``actor.ppo_max_token_len_per_gpu`` padded tokens, each padded only to its own longest prompt and
response; the old and reference log-probs likewise under ``rollout.log_prob_*`` and ``ref.log_prob_*``.
Every micro-batch's loss is its share of the mini-batch's: the token means (``token_mean``, the entropy,
the KL) divide by the mini-batch's trained tokens (``LossSettings.batch_num_tokens``) and
``per_rollout_mean`` sums advantages scaled over the whole batch, so the step equals the one-pass step
up to float rounding (a loss that declares ``additive_over_micro_batches=False`` is refused).

Prefix sharing (``agentlightning.torch.share_prefixes``, :mod:`agl_core.backends.torch.prefix_packing`):
the rows of every pass (the old and reference log-probs over the batch, each mini-batch's update) are
packed so that a prefix several rows share is computed once, the packs grouped under the same
budgets (one pass without one); a row's log-probs, entropy, and so the loss and its gradient, are
those of the padded rows up to float rounding. A pass with image rows is not packed (an image's
placeholder tokens and mrope positions belong to its row, which a shared prefix would not keep): it
takes the padded path, and ``perf/n_rows_unshared_images`` counts the step's image rows.

Vision-language rows (a ``VisionSpec`` given): tensors carry mrope position ids and each row's image
inputs (:mod:`agl_core.backends.ppo`), which every forward pass of the step hands to the
model, so the vision tower is trained with the rest of the policy.

Only the model's trainable parameters are optimised and clipped (:func:`trainable_parameters`: all of
them, or a LoRA model's adapter). Forward passes autocast as ``actor.fsdp_config.mixed_precision``
says (:mod:`agl_core.backends.precision`); log-probs, ratios, advantages and the loss are float32.

Metrics, with verl's names: ``actor/pg_loss`` (the policy-loss term alone), ``actor/entropy_loss``
(reported every update, as verl does with Agent Lightning's ``calculate_entropy: true``),
``actor/kl_loss`` and ``actor/kl_coef`` (with the KL term), ``actor/loss`` (the total that is
minimised), the policy loss's own metrics, ``actor/grad_norm``; and ``actor/n_micro_batches`` (the
forward-backward passes of all the step's updates), ``perf/padded_per_real_tokens`` (tensor elements
per token computed over those passes: the padding), ``perf/computed_per_row_tokens`` (tokens computed
per token of the rows trained: below 1 as far as prefixes are shared, 1 without sharing),
``timing/log_prob_s`` (tensors and old/reference log-probs) and ``timing/actor_update_s`` (the PPO epochs).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import attrs
import torch

from agl_core.backends.lora import base_policy
from agl_core.backends.micro_batching import (
    MULTI_MODAL_INPUTS,
    MicroBatch,
    MiniBatch,
    UpdateBatch,
    batch_results,
    row_groups,
    split,
)
from agl_core.backends.ppo import (
    ActorLoss,
    ActorStep,
    ResponseStats,
    check_splittable,
    frozen_log_probs,
    has_images,
    mini_batches,
    response_stats,
    train_batch,
    trainable_parameters,
)
from agl_core.backends.precision import Precision
from agl_core.backends.torch.prefix_packing import check_packable, pack_cost, split_shared
from agl_core.errors import UsageError
from agl_core.serving.weights import is_adapted
from agl_core.stages.pipeline import PreparedBatch
from agl_core.stages.policy_loss import LossSettings, PolicyLoss
from agl_core.stages.tensorize import tensorize

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_core.stages.vision import VisionSpec

__all__ = ["ActorSettings", "ActorUpdate"]

UPDATE_BUDGET_KEY = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
OLD_LOG_PROB_BUDGET_KEY = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
REF_LOG_PROB_BUDGET_KEY = "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"


@attrs.frozen
class ActorSettings:
    """The ``actor_rollout_ref`` values one update reads. The token budgets are ``None`` when their
    ``use_dynamic_bsz`` switch is off (one pass over the mini-batch, or over the batch for log-probs);
    the update's micro-batch rows (``actor.ppo_micro_batch_size_per_gpu``) are ``None`` when unset or
    when a token budget replaces them (verl's rule)."""

    ppo_epochs: int
    entropy_coeff: float
    kl_loss_coef: float
    grad_clip: float
    loss: LossSettings
    update_max_tokens: int | None = None
    update_micro_rows: int | None = None
    old_log_prob_max_tokens: int | None = None
    ref_log_prob_max_tokens: int | None = None
    precision: Precision = Precision()
    share_prefixes: bool = False
    """Compute each prefix that rows share once (``agentlightning.torch.share_prefixes``)."""
    max_tree_tokens: int | None = None
    """The most tokens of a tree pack and of a pass over trees (``agentlightning.torch.max_tree_tokens``)."""

    @classmethod
    def from_config(
        cls, actor_rollout_ref: DictConfig, share_prefixes: bool = False, max_tree_tokens: int | None = None
    ) -> ActorSettings:
        actor, rollout, ref = actor_rollout_ref.actor, actor_rollout_ref.rollout, actor_rollout_ref.ref
        return cls(
            ppo_epochs=int(actor.ppo_epochs),
            entropy_coeff=float(actor.entropy_coeff),
            kl_loss_coef=float(actor.kl_loss_coef),
            grad_clip=float(actor.grad_clip),
            loss=LossSettings.from_actor_config(actor),
            update_max_tokens=int(actor.ppo_max_token_len_per_gpu) if actor.use_dynamic_bsz else None,
            update_micro_rows=None
            if actor.use_dynamic_bsz or actor.ppo_micro_batch_size_per_gpu is None
            else int(actor.ppo_micro_batch_size_per_gpu),
            old_log_prob_max_tokens=int(rollout.log_prob_max_token_len_per_gpu)
            if rollout.log_prob_use_dynamic_bsz
            else None,
            ref_log_prob_max_tokens=int(ref.log_prob_max_token_len_per_gpu) if ref.log_prob_use_dynamic_bsz else None,
            precision=Precision.from_config(actor.fsdp_config),
            share_prefixes=bool(share_prefixes),
            max_tree_tokens=max_tree_tokens,
        )


class ActorUpdate:
    """PPO epochs of ``loss_fn`` over a prepared batch's mini-batches, stepping ``optimizer``;
    ``ref_model`` (the initial policy, frozen) adds the KL term when given. ``ref_model`` may be
    ``model`` itself when that is a LoRA (PEFT) model: the reference is then its base, the adapters
    disabled (:func:`~agl_core.backends.lora.base_policy`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        ref_model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        loss_fn: PolicyLoss,
        settings: ActorSettings,
        device: torch.device,
        pad_token_id: int,
        vision: VisionSpec | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ):
        split_by = "use_dynamic_bsz" if settings.update_max_tokens is not None else "ppo_micro_batch_size_per_gpu"
        if split_by != "ppo_micro_batch_size_per_gpu" or settings.update_micro_rows is not None:
            check_splittable(loss_fn, f"actor_rollout_ref.actor.{split_by}", "micro-batches")
        if ref_model is model and not is_adapted(model):
            raise UsageError("the reference policy can be the trained model itself only when it is a PEFT (LoRA) model")
        if settings.share_prefixes:
            check_packable(model)
        self.model, self.ref_model, self.scheduler = model, ref_model, scheduler
        self.pack_cost = pack_cost(model) if settings.share_prefixes else None
        self.settings = settings
        self.device, self.pad_token_id, self.vision = device, pad_token_id, vision
        self.step = ActorStep(
            forward=self.stats,
            loss=ActorLoss(loss_fn, settings.loss, settings.entropy_coeff, settings.kl_loss_coef),
            optimizer=optimizer,
            parameters=trainable_parameters(model),
            grad_clip=settings.grad_clip,
        )

    def __call__(self, prepared: PreparedBatch) -> dict[str, float]:
        """Update on ``prepared`` (which has a shaped batch): the toolkit's
        :func:`~agl_core.backends.ppo.train_batch` over its mini-batches, the lr schedule stepped; the
        actor metrics (means over the optimizer steps, counts summed), with what the passes computed."""
        assert prepared.shaped is not None
        started = time.perf_counter()
        batch = self.batch(prepared)
        log_prob_s = time.perf_counter() - started
        minis = [
            self.mini_batch(batch.rows(rows))
            for rows in mini_batches(len(prepared.shaped.rows), prepared.shaped.n_mini_batches)
        ]
        self.model.train()
        metrics = train_batch(self.step, minis, epochs=self.settings.ppo_epochs, scheduler=self.scheduler)
        counts = pass_counts([part for mini in minis for part in mini.parts], batch)
        metrics["perf/total_num_tokens"] = counts["perf/n_row_tokens"]
        metrics["perf/padded_per_real_tokens"] = counts["perf/n_padded_tokens"] / counts["perf/n_real_tokens"]
        metrics["perf/computed_per_row_tokens"] = counts["perf/n_real_tokens"] / counts["perf/n_row_tokens"]
        metrics["timing/log_prob_s"] = log_prob_s
        metrics["timing/actor_update_s"] = time.perf_counter() - started - log_prob_s
        if self.pack_cost is not None and MULTI_MODAL_INPUTS in batch.tensors:
            metrics["perf/n_rows_unshared_images"] = float(sum(1 for row in batch.tensors[MULTI_MODAL_INPUTS] if row))
        return metrics

    def batch(self, prepared: PreparedBatch) -> UpdateBatch:
        """The prepared rows as tensors on the model's device, with the log-probs of the policy before the
        update (and of the reference policy)."""
        assert prepared.shaped is not None
        padded = tensorize(prepared.shaped.rows, pad_token_id=self.pad_token_id, vision=self.vision)
        tensors: dict[str, Any] = {k: v.to(self.device) for k, v in padded.tensors.items()}
        images = padded.non_tensors.get(MULTI_MODAL_INPUTS)
        if images is not None and any(images):
            tensors[MULTI_MODAL_INPUTS] = images
        settings = self.settings
        old_log_prob = self.log_probs(self.model, tensors, settings.old_log_prob_max_tokens, OLD_LOG_PROB_BUDGET_KEY)
        ref_log_prob = None
        if self.ref_model is not None:
            with self.reference() as ref_model:
                ref_log_prob = self.log_probs(
                    ref_model, tensors, settings.ref_log_prob_max_tokens, REF_LOG_PROB_BUDGET_KEY
                )
        return UpdateBatch(
            tensors,
            prepared.advantages(tensors["response_mask"].shape[1]).to(self.device),
            old_log_prob,
            ref_log_prob,
        )

    def reference(self) -> AbstractContextManager[torch.nn.Module]:
        """The reference policy to compute log-probs with: the frozen copy, or the base of a LoRA model."""
        assert self.ref_model is not None
        return base_policy(self.model) if self.ref_model is self.model else nullcontext(self.ref_model)

    def log_probs(
        self, model: torch.nn.Module, tensors: Mapping[str, Any], max_tokens: int | None, key: str
    ) -> torch.Tensor:
        """``model``'s response log-probs of a batch as it is before the update, ``[rows, response_len]``
        (:func:`~agl_core.backends.ppo.frozen_log_probs`; 0 past each micro-batch's widths): in one pass,
        or in micro-batches of at most ``max_tokens`` padded elements (``key``'s)."""
        with self.settings.precision.autocast(self.device):
            if max_tokens is None and not self.shares(tensors):
                return frozen_log_probs(model, tensors)
            micro_batches = self.split(tensors, max_tokens, key)
            return batch_results(
                tensors, micro_batches, lambda micro: frozen_log_probs(model, micro.cut(tensors), micro.packed)
            )

    def shares(self, tensors: Mapping[str, Any]) -> bool:
        """Whether a pass over ``tensors`` packs shared prefixes: ``share_prefixes``, and no image row."""
        return self.pack_cost is not None and not has_images(tensors)

    def split(self, tensors: Mapping[str, Any], max_tokens: int | None, key: str) -> list[MicroBatch]:
        """The passes over a batch: its rows packed with their shared prefixes (:meth:`shares`), or
        in micro-batches of at most ``max_tokens`` padded elements."""
        if self.shares(tensors):
            return split_shared(tensors, max_tokens, key, self.pack_cost, self.settings.max_tree_tokens)
        assert max_tokens is not None
        return split(tensors, max_tokens, key)

    def mini_batch(self, mini: UpdateBatch) -> MiniBatch:
        """``mini``'s micro-batches: of ``update_micro_rows`` rows, each cut in token-budget
        micro-batches when ``update_max_tokens`` is set or into packs when prefixes are shared. Their
        token means divide by the mini-batch's trained tokens (or the configured
        ``LossSettings.batch_num_tokens``, a data-parallel process's)."""
        parts = [mini]
        if self.settings.update_micro_rows is not None:
            groups = row_groups(range(len(mini.mask)), self.settings.update_micro_rows)
            parts = [mini.rows(slice(group.start, group.stop)) for group in groups]
        if self.settings.update_max_tokens is not None or self.shares(mini.tensors):
            budget = self.settings.update_max_tokens
            parts = [part.cut(micro) for part in parts for micro in self.split(part.tensors, budget, UPDATE_BUDGET_KEY)]
        return MiniBatch(parts, self.settings.loss.batch_num_tokens or int(mini.mask.sum()))

    def mini_batch_step(self, mini: UpdateBatch) -> dict[str, float]:
        """One optimizer step on ``mini`` (:class:`~agl_core.backends.ppo.ActorStep` on its
        :meth:`mini_batch`): its metrics, and what its passes computed (:func:`pass_counts`)."""
        parts = self.mini_batch(mini)
        return {**self.step(parts), **pass_counts(parts.parts, mini)}

    def stats(self, rows: UpdateBatch) -> ResponseStats:
        """The policy's :class:`~agl_core.backends.ppo.ResponseStats` of ``rows``, under the configured autocast."""
        with self.settings.precision.autocast(self.device):
            return response_stats(self.model, rows.tensors, rows.packed)


def pass_counts(parts: Sequence[UpdateBatch], rows: UpdateBatch) -> dict[str, float]:
    """What the forward passes over ``parts`` (``rows`` cut into micro-batches or packs) compute:
    ``perf/n_padded_tokens`` (tensor elements), ``perf/n_real_tokens`` (the tokens among them) and
    ``perf/n_row_tokens`` (the tokens of the rows: more than the real ones where prefixes are shared)."""
    padded, real = (sum(values) for values in zip(*(part.computed for part in parts)))
    return {
        "perf/n_padded_tokens": float(padded),
        "perf/n_real_tokens": float(real),
        "perf/n_row_tokens": float(rows.tensors["attention_mask"].sum()),
    }
