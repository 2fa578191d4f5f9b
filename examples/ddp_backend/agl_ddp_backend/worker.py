"""One data-parallel rank: a copy of the policy in ``DistributedDataParallel`` over gloo, and the
PPO update on the rank's share of every mini-batch.

Rank ``r`` of ``W`` trains rows ``r, r + W, ...`` of each mini-batch. Its loss is its share of the
mini-batch's with ``dp_size = W`` and the mini-batch's trained-token count in ``LossSettings``, so
the gradients DDP averages over the ranks are the one-process gradient of the whole mini-batch.
"""

from __future__ import annotations

import io
import math
import traceback
from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist

from agl_core import LossSettings, PolicyLoss

RESPONSE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


@attrs.frozen
class UpdateSettings:
    """The ``actor_rollout_ref.actor`` values a rank reads."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    grad_clip: float
    ppo_epochs: int
    entropy_coeff: float
    loss: LossSettings


def pack(value: Any) -> bytes:
    """``value`` as bytes: tensors travel by value (a pipe would share their memory between processes)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def serve_rank(
    rank: int, world: int, store: str, model_dir: str, settings: UpdateSettings, loss: PolicyLoss, pipe: Any
):
    """A rank's process: answer the driver's packed ``(command, args)`` with ``(True, result)`` or
    ``(False, traceback)`` until ``stop``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        worker = Rank(rank, world, model_dir, settings, loss)
        while (message := unpack(pipe.recv_bytes()))[0] != "stop":
            command, args = message
            try:
                pipe.send_bytes(pack((True, getattr(worker, command)(*args))))
            except Exception:
                pipe.send_bytes(pack((False, traceback.format_exc())))
    finally:
        dist.destroy_process_group()


def log_softmax(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Log-probabilities over the vocabulary at every response position, ``[rows, response_len, vocab]``."""
    width = tensors["responses"].shape[1]
    logits = model(
        input_ids=tensors["input_ids"],
        attention_mask=tensors["attention_mask"],
        position_ids=tensors["position_ids"],
        use_cache=False,
    ).logits[:, -width - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def chosen(distributions: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    return distributions.gather(-1, responses[..., None]).squeeze(-1)


class Rank:
    """The policy, its optimizer and the update of one rank."""

    def __init__(self, rank: int, world: int, model_dir: str, settings: UpdateSettings, loss: PolicyLoss):
        from transformers import AutoModelForCausalLM

        self.rank, self.world, self.settings, self.loss_fn = rank, world, settings, loss
        self.model = torch.nn.parallel.DistributedDataParallel(
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay
        )

    def update(self, tensors: dict[str, torch.Tensor], advantages: torch.Tensor, n_mini_batches: int):
        """PPO epochs over the mini-batches; the metrics averaged over the optimizer steps, and (rank
        0) the new weights."""
        rows = advantages.shape[0]
        size = rows // n_mini_batches
        shares = [list(range(start + self.rank, start + size, self.world)) for start in range(0, rows, size)]
        old = torch.zeros(advantages.shape)
        mine = [i for share in shares for i in share]
        with torch.no_grad():
            self.model.module.eval()
            old[mine] = chosen(log_softmax(self.model.module, _rows(tensors, mine)), tensors["responses"][mine])
        self.model.module.train()
        sums: dict[str, float] = {}
        for _ in range(self.settings.ppo_epochs):
            for start, share in zip(range(0, rows, size), shares):
                n_tokens = int(tensors["response_mask"][start : start + size].sum())
                for name, value in self.step(_rows(tensors, share), advantages[share], old[share], n_tokens).items():
                    sums[name] = sums.get(name, 0.0) + value
        n_steps = self.settings.ppo_epochs * len(shares)
        metrics = {name: value / n_steps for name, value in sums.items()}
        metrics["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        return metrics, self.weights() if self.rank == 0 else None

    def step(
        self, part: dict[str, torch.Tensor], advantages: torch.Tensor, old: torch.Tensor, n_tokens: int
    ) -> dict[str, float]:
        """One optimizer step on this rank's rows of a mini-batch of ``n_tokens`` trained tokens."""
        settings = attrs.evolve(self.settings.loss, dp_size=self.world, batch_num_tokens=n_tokens)
        mask = part["response_mask"].bool()
        distributions = log_softmax(self.model, part)
        log_prob = chosen(distributions, part["responses"])
        pg_loss, pg_metrics = self.loss_fn(old, log_prob, advantages, mask, settings)
        with torch.set_grad_enabled(self.settings.entropy_coeff > 0):  # else it is only reported
            token_entropy = -(distributions.exp() * distributions).sum(-1)
            entropy = torch.where(mask, token_entropy, 0.0).sum() / n_tokens * self.world
        loss = pg_loss - self.settings.entropy_coeff * entropy
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        if math.isfinite(float(grad_norm)):
            self.optimizer.step()
        # the loss terms are each rank's share x dp_size: their mean over the ranks is the mini-batch's;
        # the loss's own metrics are token means: weighted by each rank's tokens
        names = sorted(pg_metrics)
        tokens = float(mask.sum())
        totals = torch.tensor(
            [pg_loss.item(), entropy.item(), loss.item(), tokens, *(tokens * float(pg_metrics[n]) for n in names)],
            dtype=torch.float64,
        )
        dist.all_reduce(totals)
        metrics = {"actor/pg_loss": totals[0], "actor/entropy_loss": totals[1], "actor/loss": totals[2]}
        metrics = {name: float(value) / self.world for name, value in metrics.items()}
        metrics.update({name: float(totals[4 + i] / max(float(totals[3]), 1.0)) for i, name in enumerate(names)})
        metrics["actor/grad_norm"] = float(grad_norm)
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().clone() for name, value in self.model.module.state_dict().items()}

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load(self, weights: Mapping[str, torch.Tensor], optimizer_state: Mapping[str, Any]) -> None:
        self.model.module.load_state_dict(weights)
        self.optimizer.load_state_dict(optimizer_state)


def _rows(tensors: Mapping[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    return {name: tensors[name][rows] for name in RESPONSE_KEYS}
