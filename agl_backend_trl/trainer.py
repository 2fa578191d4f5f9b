"""TRL's ``GRPOTrainer`` training agl's rows with agl's loss: :class:`AglGRPOTrainer`.

What is TRL's: the model (``peft_config`` LoRA, dropout, the reference model of ``beta``), the
accelerator that wraps it, the optimizer and lr schedule (``create_optimizer_and_scheduler``),
``training_step`` (the loss's backward through the accelerator) and the callbacks. What is agl's,
in the methods overridden where TRL expects a subclass to change them:

- ``_prepare_inputs``: TRL generates and scores completions there; agl's mini-batch comes from its
  agents, aggregated, credited and shaped by the step pipeline, so it is handed through as it is;
- ``_compute_loss`` (``compute_loss`` calls it): agl's actor loss
  (:func:`agl_core.backends.ppo.ppo_loss`: the ``loss_mode`` plugin's loss, entropy bonus, KL term)
  instead of TRL's ``loss_type``; its metrics, under agl's names, are kept for the step;
- ``get_decay_parameter_names``: every trained weight decays, as ``torch.optim.AdamW`` over all of
  them decays them in agl's other backends (transformers leaves biases and norms out).

One optimizer step (:meth:`AglGRPOTrainer.mini_batch_step`) is TRL's ``training_step`` on each
micro-batch (``actor.ppo_micro_batch_size_per_gpu`` rows; one without) of this process's share of a
mini-batch, every micro-batch's loss its share of the mini-batch's, then
:func:`agl_core.backends.ppo.optimizer_step` (clipping at ``actor.grad_clip``, a step with a
non-finite gradient norm skipped and counted), with the callbacks' optimizer events around it. In
several processes each trains its rows of the mini-batch (:func:`agl_core.backends.ppo.rank_rows`)
with its share of the loss (``dp_size``, the mini-batch's trained tokens), so the gradients
:func:`average_gradients` averages are the one-process gradient of the whole mini-batch, and the
step's metrics are gathered from every process.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from accelerate.utils import gather_object
from trl import GRPOTrainer

from agl_core import AglError, LossSettings, PolicyLoss
from agl_core.backends.ppo import (
    optimizer_step,
    ppo_loss,
    response_log_probs,
    response_stats,
    step_metrics,
    trainable_parameters,
)

__all__ = ["AglGRPOTrainer", "agents_reward", "average_gradients"]


def agents_reward(prompts: Any, completions: Any, **kwargs: Any) -> list[float]:
    """The trainer's one reward function, never called: agl's agents report the rewards, and the
    trainer never generates (TRL requires a reward source)."""
    raise AglError("backend 'trl' takes its rewards from agl's agents; TRL's reward functions are not called")


def average_gradients(parameters: Iterable[torch.nn.Parameter]) -> None:
    """Replace each gradient by its mean over the processes (DDP's average, after the backward passes
    instead of during them): one all-reduce per gradient dtype. A parameter some process has no
    gradient for counts zero there; one no process has a gradient for keeps none, so the optimizer
    skips it as it would in one process."""
    params = list(parameters)
    world = torch.distributed.get_world_size()
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    torch.distributed.all_reduce(has_grad)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for param, n in zip(params, has_grad.tolist()):
        if not n:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        by_dtype[param.grad.dtype].append(param.grad)
    for grads in by_dtype.values():
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        torch.distributed.all_reduce(flat)
        flat /= world
        for grad, mean in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(mean.view_as(grad))


class AglGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose loss is ``loss_fn`` (agl's), over inputs ``{"rows": tensors,
    "old_log_prob", "advantages", "ref_log_prob", "settings"}``: this process's rows of a padded
    mini-batch, and the ``loss_settings`` for the whole mini-batch."""

    def __init__(
        self,
        *args: Any,
        loss_fn: PolicyLoss,
        loss_settings: LossSettings,
        entropy_coeff: float,
        grad_clip: float,
        **kwargs: Any,
    ):
        super().__init__(*args, reward_funcs=agents_reward, **kwargs)
        self.loss_fn, self.loss_settings = loss_fn, loss_settings
        self.entropy_coeff, self.grad_clip = entropy_coeff, grad_clip
        self.current_gradient_accumulation_steps = 1  # set by Trainer's own loop, which agl's replaces
        self._parts: list[tuple[dict[str, float], float]] = []

    # -- TRL's methods, overridden -----------------------------------------------------------------

    def _prepare_inputs(self, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        """agl's prepared mini-batch, as it is (TRL would generate completions here)."""
        return inputs

    def _compute_loss(self, model: torch.nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
        """agl's actor loss on the mini-batch (TRL's ``loss_type`` is never used)."""
        rows = inputs["rows"]
        loss, metrics = ppo_loss(
            self.loss_fn,
            inputs["settings"],
            response_stats(model, rows),
            rows,
            inputs["old_log_prob"],
            inputs["advantages"],
            entropy_coeff=self.entropy_coeff,
            ref_log_prob=inputs["ref_log_prob"],
            kl_loss_coef=self.beta,
        )
        self._parts.append((metrics, float(rows["response_mask"].sum())))
        return loss

    def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """Every parameter's name: weight decay applies to all of them, as in agl's other backends."""
        return [name for name, _ in model.named_parameters()]

    # -- agl's step, on TRL's parts ----------------------------------------------------------------

    def reference_log_probs(self, rows: Mapping[str, Any]) -> torch.Tensor | None:
        """The reference policy's response log-probs (``beta`` > 0): TRL's reference model, or the
        LoRA model with its adapters disabled (how TRL gets its reference under PEFT)."""
        if self.beta == 0.0:
            return None
        if self.ref_model is not None:
            return response_log_probs(self.ref_model, rows)
        model = self.accelerator.unwrap_model(self.model)
        with model.disable_adapter():
            return response_log_probs(model, rows)

    def mini_batch_step(self, micro_batches: Sequence[Mapping[str, Any]], n_tokens: int) -> dict[str, float]:
        """One optimizer step on this process's rows of a mini-batch of ``n_tokens`` trained tokens
        (over every process), in ``micro_batches``: TRL's ``training_step`` on each (agl's loss, its
        backward accumulating the gradients; :func:`average_gradients` over the processes), then the toolkit's
        clipped step; the mini-batch's metrics (:func:`~agl_core.backends.ppo.step_metrics`), from
        every process's parts, and ``actor/n_micro_batches`` (this process's passes)."""
        world = self.accelerator.num_processes
        settings = attrs.evolve(self.loss_settings, dp_size=world, batch_num_tokens=n_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        self._parts = []
        for inputs in micro_batches:
            self.training_step(self.model_wrapped, {**inputs, "settings": settings}, None)
        if world > 1:
            average_gradients(trainable_parameters(self.model))
        passes = len(self._parts)
        self._metrics["train"].clear()  # TRL's step times, which only its own log() empties: agl reports its own
        parts = gather_object(self._parts) if world > 1 else self._parts
        metrics = {**step_metrics(parts, 1 / world), "actor/n_micro_batches": float(passes)}
        self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
        metrics.update(optimizer_step(self.optimizer, trainable_parameters(self.model), self.grad_clip))
        self.callback_handler.on_optimizer_step(self.args, self.state, self.control)
        return metrics
