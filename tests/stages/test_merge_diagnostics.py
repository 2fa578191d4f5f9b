"""A custom merge loop reports trajectory's merge diagnostics through AggregationCounts' public methods."""

from __future__ import annotations

import pytest

from agl_core import MISMATCH_KINDS, AggregationCounts, AggregationSettings, CompletedRollout, PluginManager, Triplet


def test_counts_made_are_reported_without_the_trajectory_flag():
    counts = AggregationCounts()
    counts.merge_break("template")
    counts.merge_break("template")
    counts.unmerged_rollout()
    metrics = counts.metrics()
    assert metrics["training/n_trace_merge_mismatch_rows"] == 2.0
    assert metrics["training/trace_merge_mismatch/template"] == 2.0
    assert metrics["training/n_unmerged_rollouts"] == 1.0
    assert "training/trace_merge_mismatch/other" not in metrics  # only trajectory=True reports zeros
    assert {f"training/trace_merge_mismatch/{kind}" for kind in MISMATCH_KINDS} <= set(counts.metrics(trajectory=True))


def test_an_unknown_break_kind_is_refused():
    with pytest.raises(ValueError, match="'typo' is not one of retokenization, template, other"):
        AggregationCounts().merge_break("typo")


def test_trajectory_counts_its_breaks_through_the_same_methods():
    broken = CompletedRollout(
        rollout_id="r",
        group_id="g",
        state="succeeded",
        final_reward=1.0,
        triplets=[Triplet(prompt_ids=[1, 2], response_ids=[3]), Triplet(prompt_ids=[9, 9], response_ids=[4])],
    )
    trajectory = PluginManager(load_entrypoints=False).aggregators["trajectory"]
    metrics = trajectory([broken], AggregationSettings(max_prompt_length=8, max_response_length=8)).metrics
    assert metrics["training/n_unmerged_rollouts"] == 1.0 and metrics["training/n_trace_merge_mismatch_rows"] == 1.0
