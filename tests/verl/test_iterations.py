"""A step trained in several mini-batches (separate_async's ``parameter_sync_step``) reports agl's
metrics over the whole step: counts and phase times add up, extremes stay extremes, the rest is a
mean weighted by each mini-batch's rollouts."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.verl

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

from agl_backend_verl.trainer import combine_iterations  # noqa: E402


def test_counts_add_extremes_stay_and_means_are_weighted_by_rollouts():
    first = {
        "training/n_rollouts": 8.0,
        "training/n_sample_dropped/same_reward": 1.0,
        "training/reward": 0.5,
        "timing/log_prob_s": 0.25,
        "training/async/staleness_max_steps": 1.0,
        "response_length/training/min_by_turn": 3.0,
        "timing/rollout_total_s/max": 4.0,
    }
    second = {
        "training/n_rollouts": 4.0,
        "training/n_sample_dropped/same_reward": 2.0,
        "training/reward": 1.0,
        "timing/log_prob_s": 0.5,
        "training/async/staleness_max_steps": 3.0,
        "response_length/training/min_by_turn": 5.0,
        "timing/rollout_total_s/max": 2.0,
    }
    combined = combine_iterations([first, second])
    assert combined["training/n_rollouts"] == 12.0
    assert combined["training/n_sample_dropped/same_reward"] == 3.0
    assert combined["training/reward"] == pytest.approx((0.5 * 8 + 1.0 * 4) / 12)
    assert combined["timing/log_prob_s"] == 0.75
    assert combined["training/async/staleness_max_steps"] == 3.0
    assert combined["response_length/training/min_by_turn"] == 3.0
    assert combined["timing/rollout_total_s/max"] == 4.0


def test_one_mini_batch_is_reported_as_it_is_and_a_missing_key_uses_the_others():
    only = {"training/n_rollouts": 8.0, "actor/pg_loss": -0.25}
    assert combine_iterations([only]) == only
    combined = combine_iterations([only, {"training/n_rollouts": 8.0}])
    assert combined["actor/pg_loss"] == -0.25
