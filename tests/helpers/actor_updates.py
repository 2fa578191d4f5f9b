"""What one step of the torch backend's actor update does to its weights."""

from __future__ import annotations

import torch

from agl_core.backends.micro_batching import UpdateBatch
from agl_core.backends.torch.update import ActorUpdate


def applied_gradients(update: ActorUpdate, batch: UpdateBatch) -> tuple[dict[str, torch.Tensor], dict]:
    """The gradient one mini-batch step of ``update`` applies (its optimizer must be SGD with lr 1, so
    it is the weights' change), by parameter name, and the step's metrics; the weights are put back."""
    before = {k: v.detach().clone() for k, v in update.model.named_parameters()}
    metrics = update.mini_batch_step(batch)
    change = {k: before[k] - v.detach() for k, v in update.model.named_parameters()}
    with torch.no_grad():
        for k, v in update.model.named_parameters():
            v.copy_(before[k])
    return change, metrics
