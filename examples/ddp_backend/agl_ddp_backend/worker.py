"""One data-parallel rank: a copy of the policy in ``DistributedDataParallel`` over gloo, and the
PPO update on the rank's share of every mini-batch.

Rank ``r`` of ``W`` trains rows ``r, r + W, ...`` of each mini-batch. Its loss is its share of the
mini-batch's with ``dp_size = W`` and the mini-batch's trained-token count in ``LossSettings``, so
the gradients DDP averages over the ranks are the one-process gradient of the whole mini-batch.
"""

from __future__ import annotations

import io
import traceback
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from agl_core import LossSettings, PolicyLoss
from agl_core.backends.dropout import load_update_model
from agl_core.backends.micro_batching import MiniBatch, UpdateBatch, row_groups
from agl_core.backends.ppo import (
    ActorLoss,
    ActorStep,
    DataParallel,
    frozen_log_probs,
    make_optimizer,
    mini_batches,
    rank_rows,
    response_stats,
    take_rows,
    train_batch,
)


def pack(value: Any) -> bytes:
    """``value`` as bytes: tensors travel by value (a pipe would share their memory between processes)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def serve_rank(
    rank: int,
    world: int,
    store: str,
    model_dir: str,
    actor: dict[str, Any],
    loss: PolicyLoss,
    disable_dropout: bool,
    pipe: Any,
):
    """A rank's process: answer the driver's packed ``(command, args)`` with ``(True, result)`` or
    ``(False, traceback)`` until ``stop``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        worker = Rank(rank, world, model_dir, actor, loss, disable_dropout)
        while (message := unpack(pipe.recv_bytes()))[0] != "stop":
            command, args = message
            try:
                pipe.send_bytes(pack((True, getattr(worker, command)(*args))))
            except Exception:
                pipe.send_bytes(pack((False, traceback.format_exc())))
    finally:
        dist.destroy_process_group()


class Rank:
    """The policy, its optimizer and the update of one rank, as ``actor`` (``actor_rollout_ref.actor``)
    says; the policy's dropout off when ``disable_dropout`` (``agentlightning.disable_dropout``)."""

    def __init__(
        self, rank: int, world: int, model_dir: str, actor: dict[str, Any], loss: PolicyLoss, disable_dropout: bool
    ):
        self.rank, self.world, self.actor = rank, world, OmegaConf.create(actor)
        model = load_update_model(model_dir, disable_dropout=disable_dropout)
        self.model = torch.nn.parallel.DistributedDataParallel(model)
        self.optimizer = make_optimizer(model, self.actor.optim)
        self.step = ActorStep(
            forward=lambda rows: response_stats(self.model, rows.tensors),
            loss=ActorLoss(loss, LossSettings.from_actor_config(self.actor), float(self.actor.entropy_coeff)),
            optimizer=self.optimizer,
            parameters=list(model.parameters()),
            grad_clip=float(self.actor.grad_clip),
            # DDP averages the gradients in a step's last backward pass, whatever number each rank runs
            data_parallel=DataParallel(world, self.gather, no_sync=self.model.no_sync),
        )

    def gather(self, parts: list[Any]) -> list[Any]:
        """Every rank's ``parts``, in rank order."""
        ranks: list[Any] = [None] * self.world
        dist.all_gather_object(ranks, parts)
        return [part for rank in ranks for part in rank]

    def update(self, tensors: dict[str, torch.Tensor], advantages: torch.Tensor, n_mini_batches: int):
        """PPO epochs over the mini-batches (the toolkit's ``train_batch``), this rank training its rows
        of each (:func:`rank_rows`) in micro-batches; the update's metrics, and (rank 0) the new weights."""
        slices = mini_batches(advantages.shape[0], n_mini_batches)
        shares = [rank_rows(rows, self.rank, self.world) for rows in slices]
        mine = [i for share in shares for i in share]
        old = torch.zeros(advantages.shape)
        old[mine] = frozen_log_probs(self.model.module, take_rows(tensors, mine))
        batch = UpdateBatch(tensors, advantages, old)
        micro_rows = self.actor.ppo_micro_batch_size_per_gpu
        minis = [
            MiniBatch([batch.rows(group) for group in row_groups(share, micro_rows)], int(batch.mask[rows].sum()))
            for rows, share in zip(slices, shares)
        ]
        self.model.train()
        metrics = train_batch(self.step, minis, epochs=int(self.actor.ppo_epochs))
        weights = {name: value.detach().clone() for name, value in self.model.module.state_dict().items()}
        return metrics, weights if self.rank == 0 else None

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load(self, weights: Mapping[str, torch.Tensor], optimizer_state: Mapping[str, Any]) -> None:
        self.model.module.load_state_dict(weights)
        self.optimizer.load_state_dict(optimizer_state)
