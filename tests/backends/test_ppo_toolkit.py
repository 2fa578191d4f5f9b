"""The update toolkit's bookkeeping (agl_core.backends.ppo): how rows are cut, how a step's parts
and an update's steps combine, the finiteness guard, and the step it runs for every loop backend
(train_batch): micro-batches that add up to one pass, the data-parallel hooks once per step, the lr
rule. Its forward passes and loss are checked through the backends built on it (the torch
backend's tests, the ddp example's contract)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from omegaconf import OmegaConf
from transformers import PretrainedConfig

from agl_core.backends.micro_batching import MiniBatch, UpdateBatch, row_groups
from agl_core.backends.ppo import (
    ActorLoss,
    ActorStep,
    DataParallel,
    ResponseStats,
    frozen_log_probs,
    lr_schedule,
    make_optimizer,
    mean_over_steps,
    micro_batches,
    mini_batches,
    optimizer_step,
    rank_rows,
    step_metrics,
    train_batch,
)
from agl_core.config import ConfigError
from agl_core.plugins import PluginManager
from agl_core.stages.policy_loss import LossSettings


def test_mini_batches_are_consecutive_equal_slices_and_ranks_share_them_round_robin():
    slices = mini_batches(8, 2)
    assert slices == [slice(0, 4), slice(4, 8)]
    assert [rank_rows(slices[1], rank, 2) for rank in range(2)] == [[4, 6], [5, 7]]
    assert sorted(i for rows in slices for rank in range(3) for i in rank_rows(rows, rank, 3)) == list(range(8))


def test_row_groups_cut_a_share_into_consecutive_groups_of_at_most_the_size():
    assert row_groups([4, 6, 8, 10, 12], 2) == [[4, 6], [8, 10], [12]]
    assert row_groups(range(3), None) == [range(3)]  # null: one pass
    with pytest.warns(DeprecationWarning, match="micro_batching.row_groups"):
        assert micro_batches([4, 6, 8], 2) == [[4, 6], [8]]


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


# -- the step every loop backend runs ----------------------------------------------------------------


class RowPolicy(torch.nn.Module):
    """A policy whose log-prob of each response token of row ``r`` is ``logsigmoid(theta[r, t])``."""

    def __init__(self, rows: int = 4, width: int = 3):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.linspace(-1.0, 1.0, rows * width).view(rows, width))

    def forward(self, rows: UpdateBatch) -> ResponseStats:
        log_prob = torch.nn.functional.logsigmoid(self.theta[rows.tensors["row"]])
        return ResponseStats(log_prob=log_prob, entropy=torch.zeros_like(log_prob))


def row_batch(policy: RowPolicy) -> UpdateBatch:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
    old = torch.nn.functional.logsigmoid(policy.theta.detach()) + 0.1 * torch.tensor([[1.0, -1.0, 0.0]] * 4)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])[:, None] * mask
    return UpdateBatch({"row": torch.arange(4), "response_mask": mask}, advantages, old)


def actor_step(policy: RowPolicy, data_parallel: DataParallel | None = None) -> ActorStep:
    loss = PluginManager(load_entrypoints=False).policy_losses.get("token_mean")
    return ActorStep(
        forward=policy,
        loss=ActorLoss(loss, LossSettings()),
        optimizer=torch.optim.SGD(policy.parameters(), lr=1.0),
        parameters=list(policy.parameters()),
        grad_clip=100.0,
        data_parallel=data_parallel,
    )


def test_a_steps_micro_batches_make_the_one_pass_step():
    one, split = RowPolicy(), RowPolicy()
    batch = row_batch(one)
    whole = actor_step(one)(MiniBatch([batch], int(batch.mask.sum())))
    parts = actor_step(split)(MiniBatch([batch.rows(rows) for rows in ([0, 1], [2, 3])], int(batch.mask.sum())))
    assert torch.allclose(one.theta, split.theta, atol=1e-7) and not torch.equal(one.theta, RowPolicy().theta)
    assert parts["actor/pg_loss"] == pytest.approx(whole["actor/pg_loss"], abs=1e-7)
    assert (whole["actor/n_micro_batches"], parts["actor/n_micro_batches"]) == (1.0, 2.0)


def test_data_parallel_hooks_run_once_per_step_and_no_sync_wraps_all_but_the_last_pass():
    calls = []

    @contextlib.contextmanager
    def no_sync():
        calls.append("no_sync")
        yield

    def gather(parts):
        calls.append("gather")
        return parts + parts  # a second process with the same parts

    policy = RowPolicy()
    batch = row_batch(policy)
    data_parallel = DataParallel(2, gather, no_sync=no_sync, reduce_gradients=lambda: calls.append("reduce"))
    three = MiniBatch([batch.rows(rows) for rows in ([0], [1, 2], [3])], 2 * int(batch.mask.sum()))
    metrics = actor_step(policy, data_parallel)(three)
    assert calls == ["no_sync", "no_sync", "reduce", "gather"]
    # each process's loss terms are its share x dp_size, the step's their mean: two processes holding
    # the same rows report the one-process loss of those rows
    alone = actor_step(RowPolicy())(MiniBatch(list(three.parts), int(batch.mask.sum())))
    assert metrics["actor/pg_loss"] == pytest.approx(alone["actor/pg_loss"], rel=1e-6)


@pytest.mark.parametrize("finite", [True, False])
def test_the_lr_schedule_steps_only_when_some_optimizer_step_was_taken(finite):
    policy = RowPolicy()
    batch = row_batch(policy)
    if not finite:
        batch = UpdateBatch(batch.tensors, batch.advantages * math.nan, batch.old_log_prob)
    step = actor_step(policy)
    scheduler = torch.optim.lr_scheduler.LambdaLR(step.optimizer, lambda n: 0.5**n)
    minis = [MiniBatch([batch.rows(rows)], int(batch.mask[rows].sum())) for rows in mini_batches(4, 2)]
    metrics = train_batch(step, minis, epochs=2, scheduler=scheduler)
    assert metrics["actor/n_updates"] == 4.0 and metrics["actor/lr"] == 1.0
    assert metrics.get("actor/n_skipped_nonfinite_grad", 0.0) == (0.0 if finite else 4.0)
    assert step.optimizer.param_groups[0]["lr"] == (0.5 if finite else 1.0)
