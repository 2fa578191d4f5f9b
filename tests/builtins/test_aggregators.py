"""Exact rows and metrics of the built-in aggregators on hand-built traces."""

import json

import numpy as np
import pytest

from agl_core.builtins.aggregators import trajectory, transition
from agl_core.config import ConfigError, load_config
from agl_core.data import DataValidationError
from agl_core.plugins import PluginManager
from agl_core.stages.aggregation import (
    Aggregation,
    AggregationSettings,
    settings_from_config,
    write_mismatches_jsonl,
)
from tests.helpers.rollouts import LIMITS, call, rollout


def test_prefix_continuing_calls_merge_with_the_observation_untrained():
    first = call([1, 2], [3, 4], log_probs=[-0.1, -0.2], reward=0.5)
    second = call([1, 2, 3, 4, 5, 6], [7], log_probs=[-0.3])
    result = trajectory([rollout(first, second, reward=0.75)], LIMITS)

    (row,) = result.rows
    assert row.prompt_ids.tolist() == [1, 2]
    assert row.response_ids.tolist() == [3, 4, 5, 6, 7]
    assert row.response_mask.tolist() == [1, 1, 0, 0, 1]
    assert row.log_probs.tolist() == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.3])
    assert row.response_turns.tolist() == [0, 0, 1, 1, 1]
    assert (row.turn_index, row.turn_rewards, row.reward, row.dropped) == (0, (0.5, None), 0.75, False)
    assert result.metrics["training/n_trace_merge_mismatch_rows"] == 0
    assert result.metrics["training/n_unmerged_rollouts"] == 0
    assert result.metrics["training/n_turns"] == 2
    assert result.mismatches == ()


def test_a_prompt_equal_to_the_context_adds_no_observation():
    result = trajectory([rollout(call([1], [2]), call([1, 2], [3]))], LIMITS)
    (row,) = result.rows
    assert row.response_ids.tolist() == [2, 3]
    assert row.response_mask.tolist() == [1, 1]


def test_a_break_starts_a_new_row_and_is_recorded():
    calls = [call([1, 2], [3]), call([1, 2, 3, 4], [5]), call([9, 9], [6, 7]), call([9, 9, 6, 7, 8], [1])]
    result = trajectory([rollout(*calls, rollout_id="r1", group_id="g1")], LIMITS)

    first, second = result.rows
    assert (first.turn_index, first.response_ids.tolist(), first.response_mask.tolist()) == (0, [3, 4, 5], [1, 0, 1])
    assert (second.turn_index, second.prompt_ids.tolist()) == (2, [9, 9])
    assert second.response_ids.tolist() == [6, 7, 8, 1]
    assert second.response_turns.tolist() == [2, 2, 3, 3]
    assert {row.rollout_id for row in result.rows} == {"r1"} and {row.group_id for row in result.rows} == {"g1"}
    assert result.metrics["training/n_trace_merge_mismatch_rows"] == 1
    assert result.metrics["training/trace_merge_mismatch/other"] == 1  # no tokenizer: unclassified
    assert result.metrics["training/n_unmerged_rollouts"] == 1
    (mismatch,) = result.mismatches
    assert (mismatch.rollout_id, mismatch.group_id, mismatch.turn_index, mismatch.kind) == ("r1", "g1", 2, "other")
    assert (mismatch.context_length, mismatch.prompt_length, mismatch.common_prefix_length) == (5, 2, 0)
    assert mismatch.context_ids == (1, 2, 3, 4, 5) and mismatch.prompt_ids == (9, 9)
    assert mismatch.context_text is None


def test_a_long_response_is_truncated_with_its_mask_and_log_probs():
    calls = [call([1], [2, 3], log_probs=[-1.0, -2.0]), call([1, 2, 3, 4, 5], [6, 7], log_probs=[-3.0, -4.0])]
    limits = AggregationSettings(max_prompt_length=10, max_response_length=5)
    result = trajectory([rollout(*calls)], limits)

    (row,) = result.rows
    assert row.response_ids.tolist() == [2, 3, 4, 5, 6]
    assert row.response_mask.tolist() == [1, 1, 0, 0, 1]
    assert row.log_probs.tolist() == [-1.0, -2.0, 0.0, 0.0, -3.0]
    assert row.response_turns.tolist() == [0, 0, 1, 1, 1]
    assert result.metrics["training/n_truncated_sample"] == 1


def test_a_prompt_over_the_limit_marks_the_row_dropped_and_keeps_it_whole():
    limits = AggregationSettings(max_prompt_length=3, max_response_length=2)
    result = trajectory([rollout(call([1, 2, 3, 4], [5, 6, 7]))], limits)

    (row,) = result.rows
    assert row.dropped
    assert row.prompt_ids.tolist() == [1, 2, 3, 4] and row.response_ids.tolist() == [5, 6, 7]
    assert result.metrics["training/n_sample_dropped/marked"] == 1
    assert result.metrics["training/n_truncated_sample"] == 0


@pytest.mark.parametrize(
    ("prompt_length", "max_response", "total", "kept", "by_total"),
    [
        (3, 10, 6, 3, 1),  # the total cap leaves 6 - 3 response tokens
        (3, 2, 6, 2, 0),  # the response cap is the tighter one: cut, but not by the total
        (3, 10, 20, 5, 0),  # within both: kept whole
        (6, 10, 6, 0, 1),  # the prompt fills the cap: nothing to train, skipped
        (8, 10, 6, 0, 1),  # ... and past it
    ],
)
def test_the_total_length_cap_cuts_the_response_as_agent_lightning_1_0_2(
    prompt_length, max_response, total, kept, by_total
):
    # 1.0.2's rule: response limit = min(max_response_length, max(total - prompt length, 0)).
    prompt, response = list(range(100, 100 + prompt_length)), [1, 2, 3, 4, 5]
    limits = AggregationSettings(max_prompt_length=10, max_response_length=max_response, max_total_length=total)
    result = trajectory([rollout(call(prompt, response))], limits)

    assert [row.response_ids.tolist() for row in result.rows] == ([response[:kept]] if kept else [])
    assert result.metrics.get("training/n_truncated_sample/total_length", 0) == by_total
    assert result.metrics["training/n_truncated_sample"] == (0 < kept < len(response))
    assert result.metrics["training/n_skipped_empty_rows"] == (kept == 0)


def test_the_total_length_cap_counts_merged_observations_and_leaves_dropped_rows_whole():
    merged = [call([1], [2, 3]), call([1, 2, 3, 4, 5], [6, 7])]  # one row: [1] + 2 3 | 4 5 | 6 7
    limits = AggregationSettings(max_prompt_length=3, max_response_length=10, max_total_length=5)
    (row,) = trajectory([rollout(*merged)], limits).rows
    assert row.response_ids.tolist() == [2, 3, 4, 5] and row.response_mask.tolist() == [1, 1, 0, 0]
    (dropped,) = trajectory([rollout(call([1, 2, 3, 4], [5, 6, 7]))], limits).rows
    assert dropped.dropped and dropped.response_ids.tolist() == [5, 6, 7]


def test_rows_without_a_trained_token_are_skipped_and_counted():
    # An empty response alone, then one whose only tokens within the limit are an observation.
    calls = [call([1], []), call([5], []), call([5, 8, 9], [7])]
    limits = AggregationSettings(max_prompt_length=10, max_response_length=2)
    result = trajectory([rollout(*calls)], limits)

    assert result.rows == ()
    assert result.metrics["training/n_skipped_empty_rows"] == 2
    assert result.metrics["training/n_truncated_sample"] == 0
    assert result.metrics["response_length/training/min_by_turn"] == 0
    assert result.metrics["response_length/training/avg_by_turn"] == pytest.approx(1 / 3)


def test_log_probs_are_dropped_when_any_merged_call_lacks_them():
    calls = [call([1], [2]), call([1, 2], [3], log_probs=None), call([7], [8])]
    result = trajectory([rollout(*calls)], LIMITS)
    merged, alone = result.rows
    assert merged.log_probs is None
    assert alone.log_probs.tolist() == [-0.5]


def test_log_probs_of_the_wrong_length_are_dropped():
    broken = call([1, 2], [3])
    # Triplet refuses this on construction; an object built around validation must not slip through.
    object.__setattr__(broken, "response_log_probs", np.array([-1.0, -2.0], dtype=np.float32))
    result = trajectory([rollout(call([1], [2]), broken)], LIMITS)
    assert result.rows[0].log_probs is None
    assert transition([rollout(broken)], LIMITS).rows[0].log_probs is None


def test_transition_makes_one_row_per_call_with_the_final_reward():
    calls = [call([1], [2], reward=0.1), call([1, 2, 3], [4, 5], log_probs=None), call([6], [])]
    limits = AggregationSettings(max_prompt_length=2, max_response_length=1)
    result = transition([rollout(*calls, reward=-1.0)], limits)

    first, second = result.rows
    assert (first.turn_index, first.turn_rewards, first.reward, first.dropped) == (0, (0.1,), -1.0, False)
    assert (second.turn_index, second.dropped, second.log_probs) == (1, True, None)
    assert second.response_turns.tolist() == [1, 1]
    assert result.metrics["training/n_sample_dropped/marked"] == 1
    assert result.metrics["training/n_skipped_empty_rows"] == 1
    assert result.metrics["training/n_turns"] == 3
    assert "training/n_trace_merge_mismatch_rows" not in result.metrics


def test_a_rollout_without_calls_gives_no_row_and_is_counted():
    result = trajectory([rollout(), rollout(call([1], [2]), rollout_id="r2")], LIMITS)
    assert [row.rollout_id for row in result.rows] == ["r2"]
    assert result.metrics["training/n_rollouts_w_trace"] == 1


@pytest.mark.parametrize("aggregate", [trajectory, transition])
def test_a_missing_final_reward_is_an_error_naming_the_rollout(aggregate):
    with pytest.raises(DataValidationError, match="rollout 'lost'.*final_reward"):
        aggregate([rollout(call([1], [2]), reward=None, rollout_id="lost")], LIMITS)


def test_built_ins_are_registered_by_name():
    registry = PluginManager(load_entrypoints=False).aggregators
    assert registry.get("trajectory") is trajectory and registry.get("transition") is transition
    assert registry.entry("trajectory").plugin_name == "aggregators"


@pytest.mark.parametrize(
    ("level", "expected"),
    [("transition", (111, 222)), ("trajectory", (333, 444)), ("retoken_merge", (333, 444))],
)
def test_settings_from_config_pick_the_limits_of_the_level(level, expected):
    cfg = load_config(
        overrides=[
            f"agentlightning.trace_aggregator.level={level}",
            "data.max_prompt_length=111",
            "data.max_response_length=222",
            "agentlightning.trace_aggregator.trajectory_max_prompt_length=333",
            "agentlightning.trace_aggregator.trajectory_max_response_length=444",
            "agentlightning.trace_aggregator.mismatch_sample_size=3",
        ]
    )
    settings = settings_from_config(cfg)
    assert (settings.max_prompt_length, settings.max_response_length) == expected
    assert (settings.mismatch_sample_size, settings.mismatch_max_length) == (3, 2000)
    assert settings.max_total_length is None


@pytest.mark.parametrize(("level", "expected"), [("transition", None), ("trajectory", 500), ("retoken_merge", 500)])
def test_the_total_length_cap_is_read_at_every_level_but_transition(level, expected):
    # As in Agent Lightning 1.0.2, whose transition level bounds rows by data.max_*_length alone.
    cfg = load_config(
        overrides=[
            f"agentlightning.trace_aggregator.level={level}",
            "agentlightning.trace_aggregator.trajectory_max_total_length=500",
        ]
    )
    assert settings_from_config(cfg).max_total_length == expected


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "many", "true"])
def test_a_bad_total_length_cap_is_refused_by_name(value):
    with pytest.raises(ConfigError, match="agentlightning.trace_aggregator.trajectory_max_total_length"):
        load_config(overrides=[f"agentlightning.trace_aggregator.trajectory_max_total_length={value}"])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("agentlightning.trace_aggregator.mismatch_sample_size=-1", "mismatch_sample_size"),
        ("agentlightning.trace_aggregator.mismatch_max_length=0", "mismatch_max_length"),
    ],
)
def test_bad_mismatch_settings_name_their_key(override, key):
    with pytest.raises(ConfigError, match=f"agentlightning.trace_aggregator.{key}"):
        load_config(overrides=[override])


def test_settings_refuse_bad_values_by_name():
    with pytest.raises(ValueError, match="max_response_length"):
        AggregationSettings(max_prompt_length=1, max_response_length=0)
    with pytest.raises(ValueError, match="tokenizer"):
        AggregationSettings(max_prompt_length=1, max_response_length=1, tokenizer=object())
    with pytest.raises(ValueError, match="max_total_length"):
        AggregationSettings(max_prompt_length=1, max_response_length=1, max_total_length=0)


def test_mismatches_are_written_as_json_lines(tmp_path):
    result = trajectory([rollout(call([1], [2]), call([3], [4]), call([5], [6]))], LIMITS)
    path = tmp_path / "logs" / "mismatches.jsonl"
    assert write_mismatches_jsonl(path, result.mismatches) == 2
    assert write_mismatches_jsonl(path, result.mismatches[:1]) == 1
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["turn_index"] for line in lines] == [1, 2, 1]
    assert lines[0]["context_ids"] == [1, 2] and lines[0]["prompt_ids"] == [3]


def test_the_result_is_plain_data():
    result = trajectory([rollout(call([1], [2]))], LIMITS)
    assert isinstance(result, Aggregation)
    assert all(isinstance(v, float) for v in result.metrics.values())


def test_aggregators_are_named_like_functions():
    """Code that names a plugin by ``fn.__name__`` works on the built-ins, which are
    PerRolloutAggregator objects, and on a third party's."""
    import functools

    from agl_core import PerRolloutAggregator, trajectory_rollout
    from agl_core.plugins import PluginManager

    for name, aggregator in PluginManager(load_entrypoints=False).aggregators.items():
        assert aggregator.__name__ == name
    assert PerRolloutAggregator(trajectory_rollout).__name__ == "trajectory_rollout"
    assert PerRolloutAggregator(functools.partial(trajectory_rollout), name="mine").__name__ == "mine"
    assert PerRolloutAggregator(functools.partial(trajectory_rollout)).__name__ == "trajectory_rollout"
