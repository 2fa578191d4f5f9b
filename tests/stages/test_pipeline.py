"""The step pipeline shared by every backend: rollouts → rows → advantages → shaped, normalised batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from agl_core.config import load_config
from agl_core.data import CompletedRollout, Triplet
from agl_core.plugins import PluginManager
from agl_core.stages.normalization import rollout_scales
from agl_core.stages.pipeline import StepPipeline, rollout_metrics, validation_metrics
from tests.helpers.rollouts import two_group_batch


def rollout(rid, group, reward, calls):
    triplets = [Triplet(prompt_ids=p, response_ids=r, response_log_probs=[-0.5] * len(r)) for p, r in calls]
    return CompletedRollout(rollout_id=rid, group_id=group, state="succeeded", triplets=triplets, final_reward=reward)


def config(*overrides):
    return load_config(
        overrides=[
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            *overrides,
        ]
    )


@pytest.fixture(scope="module")
def plugins():
    return PluginManager(load_entrypoints=False)


def test_rollouts_to_a_normalised_batch(plugins):
    prepared = StepPipeline(config(), plugins).prepare(two_group_batch(), step=1)
    assert prepared.metrics["training/n_rollouts"] == 4
    assert prepared.metrics["training/reward"] == pytest.approx(0.625)
    assert prepared.metrics["training/n_sample"] == 5
    assert prepared.metrics["training/n_skipped_updates"] == 0
    shaped = prepared.shaped
    ids = [row.rollout_id for row in shaped.rows]
    expected = rollout_scales(
        ids, [row.n_trained_tokens for row in shaped.rows], mode="rollouts", n_mini_batches=shaped.n_mini_batches
    )
    np.testing.assert_allclose(prepared.row_scales, expected)
    width = max(len(row.response_ids) for row in shaped.rows)
    raw = prepared.returns(width)  # grpo's returns are its advantages, never scaled
    scaled = prepared.advantages(width)
    torch.testing.assert_close(scaled, raw * torch.as_tensor(expected, dtype=torch.float32)[:, None])
    assert raw.abs().sum() > 0, "grpo gives non-zero advantages to groups with different rewards"


def test_token_mean_is_not_normalised_per_rollout(plugins):
    prepared = StepPipeline(config("actor_rollout_ref.actor.policy_loss.loss_mode=token_mean"), plugins).prepare(
        two_group_batch(), step=1
    )
    assert prepared.row_scales is None
    width = max(len(row.response_ids) for row in prepared.shaped.rows)
    torch.testing.assert_close(prepared.advantages(width), prepared.returns(width))


def test_nothing_trainable_skips_the_update(plugins):
    prepared = StepPipeline(config(), plugins).prepare([], step=1)
    assert prepared.shaped is None and prepared.metrics["training/n_skipped_updates"] == 1
    with pytest.raises(ValueError, match="no trainable rows"):
        prepared.advantages(8)


def test_trajectory_breaks_are_logged_as_json_lines(plugins, tmp_path):
    path = tmp_path / "logs" / "mismatches.jsonl"
    pipeline = StepPipeline(config(f"agentlightning.trace_aggregator.mismatch_log_path={path}"), plugins)
    pipeline.prepare(two_group_batch(), step=1)
    pipeline.prepare(two_group_batch(), step=2)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(m["rollout_id"], m["turn_index"], m["kind"]) for m in lines] == [("r0", 1, "other")] * 2


def test_rollout_metrics_ignore_missing_rewards():
    rollouts = [rollout("a", "g", 1.0, []), CompletedRollout(rollout_id="b", group_id="g", state="failed")]
    assert rollout_metrics(rollouts, "val") == {"val/n_rollouts": 2.0, "val/reward": 1.0}


def test_validation_metrics_are_agent_lightning_v1s_over_every_batch():
    rollouts = [*two_group_batch(), CompletedRollout(rollout_id="r4", group_id="g2", state="failed", final_reward=0.0)]
    sources = [
        {
            "training/n_rollouts_w_reward": 2.0,
            "training/rollouts/n_failed": 1.0,
            "training/gateway/poll_interval_s": 0.5,
        },
        {"training/n_rollouts_w_reward": 1.0, "timing/rollout_total_s/max": 3.0},
    ]
    metrics = validation_metrics(rollouts, sources)
    # per traced rollout: calls (2, 2, 1, 1), response tokens per call ((2, 1), (1, 2), (3,), (1,))
    assert metrics == {
        "val/n_rollouts": 5.0,
        "val/reward": pytest.approx((1.0 + 0.0 + 1.0 + 0.5 + 0.0) / 5),
        "val/n_rollouts_w_trace": 4.0,
        "val/n_rollouts_w_reward": 3.0,
        "val/turn_count": 1.5,
        "val/mean_response_length_per_turn": pytest.approx((1.5 + 1.5 + 3 + 1) / 4),
        "val/mean_total_response_length_per_rollout": 2.5,
        "val/rollouts/n_failed": 1.0,
        "val/n_batches": 2.0,
    }


def test_validation_metrics_without_any_trace_or_reward():
    metrics = validation_metrics([CompletedRollout(rollout_id="a", group_id="g", state="failed")], [{}])
    assert metrics["val/n_rollouts_w_trace"] == 0.0 and metrics["val/n_rollouts_w_reward"] == 0.0
    assert np.isnan(metrics["val/turn_count"]) and np.isnan(metrics["val/mean_response_length_per_turn"])


class _Tokenizer:
    """Ten ids; ``decode`` for the trajectory aggregator's break texts."""

    def __len__(self) -> int:
        return 10

    def decode(self, ids, **_options) -> str:
        return " ".join(map(str, ids))


def test_calls_outside_the_tokenizer_vocabulary_are_removed_before_aggregation(plugins):
    rollouts = two_group_batch()
    rollouts.append(rollout("r4", "g1", 0.0, [([1], [2, 10])]))  # id 10: the eleventh, not in the vocabulary
    prepared = StepPipeline(config(), plugins, _Tokenizer()).prepare(rollouts, step=1)
    assert prepared.metrics["training/events/n_calls_out_of_vocab"] == 1
    assert "r4" not in {row.rollout_id for row in prepared.shaped.rows}
    assert prepared.metrics["training/n_sample"] == 5
    without_tokenizer = StepPipeline(config(), plugins).prepare(two_group_batch(), step=1)
    assert "training/events/n_calls_out_of_vocab" not in without_tokenizer.metrics


def test_a_group_left_with_one_rollout_is_dropped_and_counted_not_fatal(plugins):
    """r3 lost every call (to bad events, or it failed and was skipped): group g1 keeps r2 alone."""
    rollouts = two_group_batch()
    rollouts[3] = rollout("r3", "g1", 0.5, [])
    prepared = StepPipeline(config("actor_rollout_ref.actor.ppo_mini_batch_size=1"), plugins).prepare(rollouts, step=1)
    assert prepared.metrics["training/n_groups_dropped_one_rollout_left"] == 1
    assert {row.group_id for row in prepared.shaped.rows} == {"g0"}
    assert (
        StepPipeline(config(), plugins)
        .prepare(two_group_batch(), step=1)
        .metrics["training/n_groups_dropped_one_rollout_left"]
        == 0
    )


def test_with_one_rollout_per_sample_groups_of_one_are_the_estimators_to_judge(plugins):
    rollouts = [rollout("r0", "g0", 1.0, [([1], [2])]), rollout("r1", "g1", 0.0, [([1], [3])])]
    settings = [
        "actor_rollout_ref.rollout.n=1",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    ]
    prepared = StepPipeline(config(*settings, "algorithm.adv_estimator=reinforce"), plugins).prepare(rollouts, step=1)
    assert len(prepared.shaped.rows) == 2 and "training/n_groups_dropped_one_rollout_left" not in prepared.metrics
    with pytest.raises(Exception, match="needs at least 2 per group"):
        StepPipeline(config(*settings, "algorithm.adv_estimator=grpo"), plugins).prepare(rollouts, step=1)
