"""Staleness: how many weight updates behind the trained policy each model call's weights were."""

from __future__ import annotations

import pytest

from agl_core.data import CompletedRollout, Triplet
from agl_core.stages.pipeline import staleness_metrics


def rollout(rid: str, versions: list[object]) -> CompletedRollout:
    triplets = [
        Triplet(prompt_ids=[1, 2], response_ids=[3], response_log_probs=[-0.1], metadata={"model_version": v})
        for v in versions
    ]
    return CompletedRollout(rollout_id=rid, group_id="g", state="succeeded", triplets=triplets, final_reward=1.0)


def test_calls_on_the_weights_the_step_updates_are_not_stale():
    # Step 3 updates the weights pushed at step 2.
    metrics = staleness_metrics([rollout("a", [2, 2]), rollout("b", [2])], step=3)
    assert metrics == {
        "training/async/n_calls_wo_model_version": 0.0,
        "training/async/staleness_max_steps": 0.0,
        "training/async/staleness_mean_steps": 0.0,
        "training/async/n_stale_calls": 0.0,
    }


def test_carried_over_calls_lag_by_the_updates_since_they_ran():
    # A rollout that started under version 0 and finished under version 2, trained at step 4.
    metrics = staleness_metrics([rollout("a", [0, 2]), rollout("b", [3])], step=4)
    assert metrics["training/async/staleness_max_steps"] == 3.0
    assert metrics["training/async/staleness_mean_steps"] == pytest.approx((3 + 1 + 0) / 3)
    assert metrics["training/async/n_stale_calls"] == 2.0


def test_calls_without_a_version_are_counted_not_guessed():
    metrics = staleness_metrics([rollout("a", [None, "1", True, 1])], step=2)
    assert metrics["training/async/n_calls_wo_model_version"] == 3.0
    assert metrics["training/async/staleness_max_steps"] == 0.0
    only_missing = staleness_metrics([rollout("b", [None])], step=2)
    assert only_missing == {"training/async/n_calls_wo_model_version": 1.0}
