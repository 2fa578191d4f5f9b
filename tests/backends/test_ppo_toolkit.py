"""The update toolkit's bookkeeping (agl_core.backends.ppo): how rows are cut, how a step's parts
and an update's steps combine, and the finiteness guard. Its forward passes and loss are checked
through the backends built on it (the torch backend's tests, the ddp example's contract)."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from transformers import PretrainedConfig

from agl_core.backends.ppo import (
    frozen_log_probs,
    lr_schedule,
    make_optimizer,
    mean_over_steps,
    micro_batches,
    mini_batches,
    optimizer_step,
    rank_rows,
    step_metrics,
)
from agl_core.config import ConfigError


def test_mini_batches_are_consecutive_equal_slices_and_ranks_share_them_round_robin():
    slices = mini_batches(8, 2)
    assert slices == [slice(0, 4), slice(4, 8)]
    assert [rank_rows(slices[1], rank, 2) for rank in range(2)] == [[4, 6], [5, 7]]
    assert sorted(i for rows in slices for rank in range(3) for i in rank_rows(rows, rank, 3)) == list(range(8))


def test_micro_batches_cut_a_share_into_consecutive_groups_of_at_most_the_size():
    assert micro_batches([4, 6, 8, 10, 12], 2) == [[4, 6], [8, 10], [12]]
    assert micro_batches(range(3), None) == [range(3)]  # null: one pass


def test_the_old_log_probs_are_taken_without_gradient_in_eval_mode_and_training_mode_is_restored():
    seen = []

    class Policy(torch.nn.Module):
        """Zero hidden states at every position, so every token's log-prob is -log(vocab)."""

        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.config = PretrainedConfig()

        def get_output_embeddings(self):
            return self.head

        def forward(self, input_ids, logits_to_keep, **_):
            seen.append((self.training, torch.is_grad_enabled()))
            hidden = torch.zeros(*input_ids.shape, 3)
            return type("Output", (), {"logits": self.head(hidden[:, -logits_to_keep:])})

    policy = Policy().train()
    ids = torch.zeros(2, 4, dtype=torch.long)
    tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": ids, "responses": ids[:, :2]}
    log_probs = frozen_log_probs(policy, tensors)
    assert seen == [(False, False)] and policy.training and not log_probs.requires_grad
    assert torch.allclose(log_probs, torch.full((2, 2), -math.log(5)))


def test_the_optimizer_and_schedule_follow_the_optim_keys_and_refuse_an_unknown_schedule_by_key():
    optim = OmegaConf.create(
        {"lr": 0.1, "betas": [0.8, 0.9], "weight_decay": 0.0, "lr_scheduler_type": "cosine"}
        | {"lr_warmup_steps": 2, "min_lr_ratio": 0.5}
    )
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)  # a frozen weight (LoRA's base) is not optimised
    optimizer = make_optimizer(model, optim)
    assert optimizer.param_groups[0]["params"] == [model.weight] and optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    schedule = lr_schedule(optimizer, optim, total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs == pytest.approx(
        [
            0.05,
            0.1,
            0.1,
            0.1 * (0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi / 4))),
            0.075,
            0.1 * (0.5 + 0.25 * (1 + math.cos(3 * math.pi / 4))),
        ]
    )
    with pytest.raises(ConfigError) as error:
        lr_schedule(optimizer, OmegaConf.merge(optim, {"lr_scheduler_type": "linear"}), 6)
    assert error.value.key == "actor_rollout_ref.actor.optim.lr_scheduler_type"


def test_a_steps_loss_terms_add_up_and_its_other_metrics_are_token_weighted():
    parts = [
        ({"actor/pg_loss": 0.25, "actor/pg_clipfrac": 0.5}, 30.0),
        ({"actor/pg_loss": 0.5, "actor/pg_clipfrac": 0.0}, 10.0),
    ]
    assert step_metrics(parts) == pytest.approx({"actor/pg_loss": 0.75, "actor/pg_clipfrac": 0.375})
    # data-parallel ranks: each term is its share x dp_size, so the step's is their mean
    assert step_metrics(parts, additive_scale=0.5)["actor/pg_loss"] == pytest.approx(0.375)


def test_an_updates_metrics_are_means_over_its_steps_with_counts_summed():
    steps = [
        {"actor/loss": 1.0, "actor/n_micro_batches": 2.0, "perf/n_real_tokens": 10.0},
        {
            "actor/loss": 3.0,
            "actor/n_micro_batches": 3.0,
            "perf/n_real_tokens": 5.0,
            "actor/n_skipped_nonfinite_grad": 1.0,
        },
    ]
    assert mean_over_steps(steps) == {
        "actor/loss": 2.0,
        "actor/n_micro_batches": 5.0,
        "perf/n_real_tokens": 15.0,
        "actor/n_skipped_nonfinite_grad": 1.0,
        "actor/n_updates": 2.0,
    }


@pytest.mark.parametrize("gradient", [1.0, math.inf, math.nan])
def test_a_step_with_a_non_finite_gradient_norm_is_skipped_and_counted(gradient):
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    weight.grad = torch.tensor([gradient, 0.0])
    metrics = optimizer_step(optimizer, [weight], grad_clip=10.0)
    finite = math.isfinite(gradient)
    assert metrics.get("actor/n_skipped_nonfinite_grad") == (None if finite else 1.0)
    assert torch.equal(weight.detach(), torch.tensor([0.9, 1.0]) if finite else torch.ones(2))
    assert metrics["actor/grad_norm"] == gradient or not finite
