"""The built-in aggregators pass the contract suite that ships for third-party aggregators, and the
suite fails aggregators that break its invariants, saying what the row should have been."""

import importlib.metadata

import attrs
import pytest
from hypothesis import Phase, find, settings
from hypothesis import strategies as st

from agl_core import Aggregation, AggregationCounts, Segment, hookimpl, merged_row, rollout_reward
from agl_core.builtins import aggregators
from agl_core.builtins.aggregators import trajectory
from agl_core.testing.aggregator_checks import check_metrics, check_tokens
from agl_core.testing.contracts import AggregatorContract, check_aggregation, check_input_unchanged
from agl_core.testing.lookup import contract_manager
from agl_core.testing.snapshots import snapshot
from agl_core.testing.strategies import aggregation_settings, rollout_batches
from tests.helpers.rollouts import LIMITS, call, rollout


class TestTransitionContract(AggregatorContract):
    aggregator_name = "transition"


class TestTrajectoryContract(AggregatorContract):
    aggregator_name = "trajectory"


def last_call_only(rollouts, agg_settings):
    """Trains only each rollout's last call, on purpose, and counts the calls it leaves out."""
    counts = AggregationCounts()
    rows = []
    for r in rollouts:
        rollout_reward(r)
        counts.add_rollout(r)
        if not r.triplets:
            continue
        counts.leave_out(len(r.triplets) - 1)
        index = len(r.triplets) - 1
        row = merged_row(r, [Segment(index, r.triplets[index], r.triplets[index].prompt_ids[:0])], agg_settings, counts)
        if row is not None:
            rows.append(row)
    return Aggregation(rows, counts.metrics(trajectory=False))


class LastCallOnly:
    @hookimpl
    def agl_register_aggregators(self, register):
        register("last_call_only", last_call_only)


class TestAnAggregatorThatLeavesCallsOutOnPurpose(AggregatorContract):
    aggregator_name = "last_call_only"
    plugins = (LastCallOnly(), aggregators)  # a built-in listed again is not registered twice
    leaves_calls_out = True


def _rows(change):
    def aggregate(rollouts, agg_settings):
        result = trajectory(rollouts, agg_settings)
        return attrs.evolve(result, rows=change(result.rows))

    return aggregate


def _metric(name, value):
    def aggregate(rollouts, agg_settings):
        result = trajectory(rollouts, agg_settings)
        return attrs.evolve(result, metrics={**result.metrics, name: value})

    return aggregate


def _ignores_the_total_length_cap(rollouts, agg_settings):
    return trajectory(rollouts, attrs.evolve(agg_settings, max_total_length=None))


def _sorts_in_place(rollouts, agg_settings):
    rollouts.sort(key=lambda r: r.rollout_id)
    return trajectory(rollouts, agg_settings)


def _unmarked_left_out(rollouts, agg_settings):
    return attrs.evolve(last_call_only(rollouts, agg_settings), metrics=trajectory([], agg_settings).metrics)


BROKEN = {
    "trains observations": _rows(
        lambda rows: [attrs.evolve(r, response_mask=[1] * len(r.response_mask)) for r in rows]
    ),
    "trains a call twice": _rows(lambda rows: [*rows, *rows]),
    "wrong group id": _rows(lambda rows: [attrs.evolve(r, group_id="elsewhere") for r in rows]),
    "wrong reward": _rows(lambda rows: [attrs.evolve(r, reward=r.reward + 1) for r in rows]),
    "loses log-probs": _rows(lambda rows: [attrs.evolve(r, log_probs=None) for r in rows]),
    "does not mark over-long prompts": _rows(lambda rows: [attrs.evolve(r, dropped=False) for r in rows]),
    "drops the last token": _rows(
        lambda rows: [
            attrs.evolve(
                r,
                response_ids=r.response_ids[:-1],
                response_mask=r.response_mask[:-1],
                log_probs=None if r.log_probs is None else r.log_probs[:-1],
                response_turns=r.response_turns[:-1],
            )
            for r in rows
        ]
    ),
    "ignores max_total_length": _ignores_the_total_length_cap,
    "does not count truncation": _metric("training/n_truncated_sample", 0.0),
    "does not count the total-length cuts": _metric("training/n_truncated_sample/total_length", 0.0),
    "does not count skipped rows": _metric("training/n_skipped_empty_rows", 0.0),
    "miscounts breaks": _metric("training/n_trace_merge_mismatch_rows", 0.0),
    "leaves calls out without declaring it": _unmarked_left_out,
}


def _violation(aggregate, check):
    """The first generated case on which ``check`` fails ``aggregate`` (only generation: the first
    violating batch is enough, shrinking it would only cost time)."""

    def violates(case):
        batch, agg_settings = case
        try:
            check(batch, agg_settings, aggregate)
        except AssertionError:
            return True
        return False

    no_shrinking = settings(max_examples=2000, database=None, phases=[Phase.generate])
    return find(st.tuples(rollout_batches(), aggregation_settings()), violates, settings=no_shrinking)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_contract_fails_a_broken_aggregator(name):
    _violation(BROKEN[name], lambda batch, s, aggregate: check_aggregation(batch, s, aggregate(batch, s)))


def _mutation_check(batch, agg_settings, aggregate):
    before = snapshot(batch)
    aggregate(batch, agg_settings)
    check_input_unchanged(before, snapshot(batch), "aggregator 'sorting'")


def test_an_aggregator_that_sorts_its_input_in_place_is_caught_and_the_reordering_shown():
    found, agg_settings = _violation(_sorts_in_place, _mutation_check)
    batch = sorted(found, key=lambda r: r.rollout_id, reverse=True)  # find() returns the batch as sorted
    ids = [r.rollout_id for r in batch]
    with pytest.raises(AssertionError, match="the rollouts were reordered in place: rollout_ids before") as err:
        _mutation_check(batch, agg_settings, _sorts_in_place)
    assert repr(sorted(ids)[0])[:20] in str(err.value)


def test_a_changed_field_is_shown_with_its_path_and_both_values():
    batch = [rollout(call([1, 2], [3, 4]), rollout_id="a"), rollout(call([5], [6]), rollout_id="b")]
    before = snapshot(batch)
    batch[1] = attrs.evolve(batch[1], final_reward=0.0)
    with pytest.raises(AssertionError, match=r"rollouts\[1\] \(rollout_id 'b'\)\.final_reward was 1\.0, now 0\.0"):
        check_input_unchanged(before, snapshot(batch), "aggregator 'x'")
    batch.pop()
    with pytest.raises(AssertionError, match="the list of rollouts went from 2 to 1 items"):
        check_input_unchanged(before, snapshot(batch), "aggregator 'x'")


def test_an_off_by_one_cut_says_what_the_row_should_have_been():
    limits = attrs.evolve(LIMITS, max_response_length=4)
    batch = [rollout(call([1], [2, 3, 4, 5, 6]))]
    cut_one_short = _rows(
        lambda rows: [
            attrs.evolve(
                r,
                response_ids=r.response_ids[:3],
                response_mask=r.response_mask[:3],
                log_probs=r.log_probs[:3],
                response_turns=r.response_turns[:3],
            )
            for r in rows
        ]
    )
    with pytest.raises(AssertionError) as err:
        check_tokens(batch, cut_one_short(batch, limits), limits)
        check_aggregation(batch, limits, cut_one_short(batch, limits))
    message = str(err.value)
    assert "call 0: 2 of its 5 response tokens are missing and the row's response has 3 tokens" in message
    assert "cut only at max_response_length = 4, so it should have 4 response tokens" in message
    assert "without truncation" not in message


def test_left_out_calls_must_be_declared_and_are_not_skipped_rows():
    batch = [rollout(call([1], [2]), call([1, 2, 9], [3]), call([1, 2, 9, 3, 9], [4]))]
    result = last_call_only(batch, LIMITS)
    assert result.metrics["training/n_calls_left_out"] == 2 and result.metrics["training/n_skipped_empty_rows"] == 0
    check_metrics(batch, result, LIMITS, leaves_calls_out=True)
    with pytest.raises(AssertionError, match="does not declare that it leaves calls out"):
        check_metrics(batch, result, LIMITS)
    uncounted = attrs.evolve(result, metrics={**result.metrics, "training/n_calls_left_out": 0.0})
    with pytest.raises(AssertionError, match="2 calls in 1 runs are in no row"):
        check_metrics(batch, uncounted, LIMITS, leaves_calls_out=True)


def test_the_contract_manager_loads_no_entry_point_and_registers_a_plugin_once(monkeypatch):
    class Installed:
        name, value, dist = "installed", "somewhere:plugin", None

        def load(self):
            raise AssertionError("the contract loaded an installed entry point")

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [Installed()])
    plugin = LastCallOnly()
    manager = contract_manager([plugin, aggregators, plugin])
    assert "last_call_only" in manager.aggregators and "trajectory" in manager.aggregators


def test_a_declared_call_whose_prompt_fills_the_total_length_cap_may_go_untrained():
    """Its response has no room in any row (the cap cuts it to nothing and the row is skipped), so the
    declared-calls check must not demand it; a call with room is still demanded."""
    from agl_core.testing.contracts import check_trained_calls

    capped = attrs.evolve(LIMITS, max_total_length=4)
    full = rollout(call([1, 2, 3, 4], [5, 6]))
    nothing_trained = Aggregation(rows=())
    check_trained_calls([full], nothing_trained, capped, lambda r, s: [0])
    roomy = rollout(call([1, 2], [5, 6]))
    with pytest.raises(AssertionError, match="calls \\[0\\] should be trained"):
        check_trained_calls([roomy], nothing_trained, capped, lambda r, s: [0])


def test_a_total_length_cut_through_observation_tokens_only_is_a_cut():
    """The cap may cut a merged row after its last trained token (an observation the next call's
    prompt added): the row is counted in the total-length metric though it lost no trained token."""
    capped = attrs.evolve(LIMITS, max_prompt_length=2, max_total_length=4)
    merged = rollout(call([1, 2], [3]), call([1, 2, 3, 7, 7, 7], []))
    result = trajectory([merged], capped)
    (row,) = result.rows
    assert row.response_ids.tolist() == [3, 7]
    assert result.metrics["training/n_truncated_sample/total_length"] == 1
    check_metrics([merged], result, capped)
    with pytest.raises(AssertionError, match="training/n_truncated_sample/total_length is 2.0, expected between 0"):
        check_metrics([merged], attrs.evolve(result, metrics={**result.metrics, TOTAL_LENGTH: 2.0}), capped)


TOTAL_LENGTH = "training/n_truncated_sample/total_length"
