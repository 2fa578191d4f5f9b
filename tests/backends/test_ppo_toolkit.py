"""The update toolkit's bookkeeping (agl_core.backends.ppo): how rows are cut, how a step's parts
and an update's steps combine, and the finiteness guard. Its forward passes and loss are checked
through the backends built on it (the torch backend's tests, the ddp example's contract)."""

from __future__ import annotations

import math

import pytest
import torch

from agl_core.backends.ppo import mean_over_steps, mini_batches, optimizer_step, rank_rows, step_metrics


def test_mini_batches_are_consecutive_equal_slices_and_ranks_share_them_round_robin():
    slices = mini_batches(8, 2)
    assert slices == [slice(0, 4), slice(4, 8)]
    assert [rank_rows(slices[1], rank, 2) for rank in range(2)] == [[4, 6], [5, 7]]
    assert sorted(i for rows in slices for rank in range(3) for i in rank_rows(rows, rank, 3)) == list(range(8))


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
