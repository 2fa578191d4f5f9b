"""TRL's ``GRPOTrainer`` holding agl's policy: :class:`AglGRPOTrainer`.

What is TRL's: the model (``peft_config`` LoRA, dropout, the reference model of ``beta``), the
accelerator that wraps it and runs the backward pass, the optimizer and lr schedule
(``create_optimizer_and_scheduler``), the loss's autocast context and the callbacks. What is agl's:
the step (:func:`agl_core.backends.ppo.train_batch`, driven by :mod:`agl_backend_trl.backend`), with
agl's actor loss (the ``loss_mode`` plugin's loss, entropy bonus, KL term) instead of TRL's
``loss_type``; TRL's ``_prepare_inputs`` and ``_compute_loss``, which generate completions and compute
TRL's loss, are never called. Overridden here: ``get_decay_parameter_names``: every trained weight
decays, as ``torch.optim.AdamW`` over all of them decays them in agl's other backends (transformers
leaves biases and norms out).

In several processes each trains its rows of a mini-batch (:func:`agl_core.backends.ppo.rank_rows`)
with its share of the loss (``dp_size``, the mini-batch's trained tokens), so the gradients
:func:`average_gradients` averages are the one-process gradient of the whole mini-batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from trl import GRPOTrainer

from agl_core import AglError
from agl_core.backends.ppo import frozen_log_probs

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
    """``GRPOTrainer`` with agents' rewards, whose steps agl's loop takes (:mod:`agl_backend_trl.backend`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, reward_funcs=agents_reward, **kwargs)

    def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """Every parameter's name: weight decay applies to all of them, as in agl's other backends."""
        return [name for name, _ in model.named_parameters()]

    def reference_log_probs(self, rows: Mapping[str, Any]) -> torch.Tensor | None:
        """The reference policy's response log-probs (``beta`` > 0): TRL's reference model, or the
        LoRA model with its adapters disabled (how TRL gets its reference under PEFT)."""
        if self.beta == 0.0:
            return None
        if self.ref_model is not None:
            return frozen_log_probs(self.ref_model, rows)
        model = self.accelerator.unwrap_model(self.model)
        with model.disable_adapter():
            return frozen_log_probs(model, rows)
