"""Rows of a vision-language chat: each row carries the images whose placeholder blocks it holds, a
history whose images changed breaks the trajectory, and a cut never keeps part of a block."""

from __future__ import annotations

import numpy as np
import pytest

from agl_core.builtins.aggregators import trajectory, transition
from agl_core.data import DataValidationError, RolloutRequest
from agl_core.errors import UsageError
from agl_core.rollouts.events import completed_rollout
from agl_core.stages.aggregation import AggregationCounts, AggregationSettings, Segment, merged_row
from agl_core.stages.tensorize import tensorize
from agl_core.stages.vision import placeholder_runs
from tests.helpers import vision_rows as v


def chat_rollout(calls, rollout_id="vl"):
    request = RolloutRequest(rollout_id=rollout_id, group_id="g", input={})
    rollout, _ = completed_rollout(request, v.chat_events(calls), state="succeeded", reward_fillna_value=0.0)
    return rollout


def settings(**limits):
    return AggregationSettings(
        **{"max_prompt_length": 64, "max_response_length": 64, **limits}, tokenizer=v.tokenizer()
    )


def n_blocks(row):
    ids = np.concatenate([row.prompt_ids, row.response_ids])
    return len(placeholder_runs(ids, v.placeholders().image_pad, v.placeholders().vision_start))


def test_transition_rows_carry_their_calls_images():
    result = transition([chat_rollout(v.chat_calls())], settings())
    assert [row.image_urls for row in result.rows] == [(v.URL_A,), (v.URL_A, v.URL_B)]
    assert [n_blocks(row) for row in result.rows] == [1, 2]


def test_the_trajectory_row_keeps_both_images_in_order():
    result = trajectory([chat_rollout(v.chat_calls())], settings())
    [row] = result.rows
    assert row.image_urls == (v.URL_A, v.URL_B) and n_blocks(row) == 2
    assert result.metrics["training/trace_merge_mismatch/images"] == 0
    # The row becomes tensors whose vision inputs match its blocks.
    batch = tensorize([row], vision=v.spec())
    assert batch.non_tensors["multi_modal_inputs"][0]["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4]]


@pytest.mark.parametrize(
    "second_images",
    [(v.URL_B, v.URL_B), (v.URL_B,), ()],
    ids=["first-image-replaced", "first-image-removed", "all-removed"],
)
def test_a_history_whose_images_changed_breaks_the_trajectory_as_images(second_images):
    calls = v.chat_calls()
    # The chat's ids (its blocks' sizes unchanged), other images in turn 2's history: only images tell it.
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in second_images]
    calls[1]["messages"] = [{"role": "user", "content": [{"type": "text", "text": "look at"}, *parts]}]
    result = trajectory([chat_rollout(calls)], settings())
    assert [row.image_urls for row in result.rows] == [(v.URL_A,), second_images]
    assert result.metrics["training/trace_merge_mismatch/images"] == 1
    assert result.metrics["training/n_trace_merge_mismatch_rows"] == 1
    assert result.metrics["training/n_unmerged_rollouts"] == 1
    assert [m.kind for m in result.mismatches] == ["images"] and result.mismatches[0].turn_index == 1


def response_start_of_second_block(row):
    ids = np.concatenate([row.prompt_ids, row.response_ids])
    runs = placeholder_runs(ids, v.placeholders().image_pad, v.placeholders().vision_start)
    return runs[1][0] - 1 - len(row.prompt_ids)  # the second block's vision_start, in the response


@pytest.mark.parametrize("inside", [1, 2, 3])  # after vision_start, between the pads, before vision_end
def test_a_cut_through_a_placeholder_block_drops_the_row_counted(inside):
    full = trajectory([chat_rollout(v.chat_calls())], settings()).rows[0]
    cut = response_start_of_second_block(full) + inside
    result = trajectory([chat_rollout(v.chat_calls())], settings(max_response_length=cut))
    [row] = result.rows
    assert row.dropped and row.image_urls == (v.URL_A, v.URL_B)
    assert np.array_equal(row.response_ids, full.response_ids)  # kept whole, as every dropped row
    assert result.metrics["training/n_sample_dropped/marked"] == 1
    assert result.metrics["training/images/n_rows_dropped_at_cut"] == 1
    assert result.metrics["training/n_truncated_sample"] == 0


@pytest.mark.parametrize("after", [0, 4])  # at the block's start; right after its end (start, 2 pads, end)
def test_a_cut_beside_a_block_keeps_only_the_whole_blocks_images(after):
    full = trajectory([chat_rollout(v.chat_calls())], settings()).rows[0]
    cut = response_start_of_second_block(full) + after
    result = trajectory([chat_rollout(v.chat_calls())], settings(max_response_length=cut))
    [row] = result.rows
    assert not row.dropped and len(row.response_ids) == cut
    assert row.image_urls == ((v.URL_A,) if after == 0 else (v.URL_A, v.URL_B))
    assert n_blocks(row) == len(row.image_urls)
    assert result.metrics["training/n_truncated_sample"] == 1
    assert "training/images/n_rows_dropped_at_cut" not in result.metrics


def test_the_total_length_cap_drops_a_row_it_would_cut_through_a_block():
    full = trajectory([chat_rollout(v.chat_calls())], settings()).rows[0]
    cut = response_start_of_second_block(full) + 2
    result = trajectory([chat_rollout(v.chat_calls())], settings(max_total_length=len(full.prompt_ids) + cut))
    assert result.rows[0].dropped and result.metrics["training/images/n_rows_dropped_at_cut"] == 1


def test_a_prompt_over_its_limit_keeps_the_row_whole_with_its_images():
    result = transition([chat_rollout(v.chat_calls())], settings(max_prompt_length=8))
    assert [(row.dropped, row.image_urls) for row in result.rows] == [
        (True, (v.URL_A,)),
        (True, (v.URL_A, v.URL_B)),
    ]


def test_cutting_a_row_with_images_needs_the_placeholder_ids():
    no_ids = AggregationSettings(max_prompt_length=64, max_response_length=3)
    with pytest.raises(UsageError, match="'vl'.*image placeholder tokens"):
        trajectory([chat_rollout(v.chat_calls())], no_ids)


def test_merging_calls_whose_images_diverge_is_refused_by_name():
    rollout = chat_rollout(v.chat_calls())
    a, b = rollout.triplets
    diverged = [Segment(0, b, np.zeros(0, np.int64)), Segment(1, a, np.zeros(0, np.int64))]
    with pytest.raises(DataValidationError, match="do not start with the 2 image") as info:
        merged_row(rollout, diverged, settings(), AggregationCounts())
    assert info.value.rollout_id == "vl" and info.value.field == "triplets[1].image_urls"


def test_text_rows_carry_no_images_and_serialise_as_before():
    calls = v.chat_calls()
    for call in calls:
        call["messages"] = [{"role": "user", "content": "look at this"}]
    rollout = chat_rollout(calls)
    for aggregator in (transition, trajectory):
        for row in aggregator([rollout], settings()).rows:
            assert row.image_urls == () and "image_urls" not in row.to_dict()
