"""The built-in aggregators pass the contract suite that ships for third-party aggregators, and the
suite fails aggregators that break its invariants."""

import attrs
import pytest
from hypothesis import Phase, find, settings
from hypothesis import strategies as st

from agl_core.stages.levels import trajectory
from agl_core.testing.contracts import AggregatorContract, check_aggregation
from agl_core.testing.strategies import aggregation_settings, rollout_batches


class TestTransitionContract(AggregatorContract):
    aggregator_name = "transition"


class TestTrajectoryContract(AggregatorContract):
    aggregator_name = "trajectory"


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


BROKEN = {
    "trains observations": _rows(lambda rows: [attrs.evolve(r, response_mask=[1] * len(r.response_mask)) for r in rows]),
    "trains a call twice": _rows(lambda rows: [*rows, *rows]),
    "wrong group id": _rows(lambda rows: [attrs.evolve(r, group_id="elsewhere") for r in rows]),
    "wrong reward": _rows(lambda rows: [attrs.evolve(r, reward=r.reward + 1) for r in rows]),
    "loses log-probs": _rows(lambda rows: [attrs.evolve(r, log_probs=None) for r in rows]),
    "does not mark over-long prompts": _rows(lambda rows: [attrs.evolve(r, dropped=False) for r in rows]),
    "drops the last token": _rows(
        lambda rows: [
            attrs.evolve(r, response_ids=r.response_ids[:-1], response_mask=r.response_mask[:-1],
                         log_probs=None if r.log_probs is None else r.log_probs[:-1],
                         response_turns=r.response_turns[:-1])
            for r in rows
        ]
    ),
    "does not count truncation": _metric("training/n_truncated_sample", 0.0),
    "does not count skipped rows": _metric("training/n_skipped_empty_rows", 0.0),
    "miscounts breaks": _metric("training/n_trace_merge_mismatch_rows", 0.0),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_contract_fails_a_broken_aggregator(name):
    aggregate = BROKEN[name]

    def violates(case):
        batch, agg_settings = case
        try:
            check_aggregation(batch, agg_settings, aggregate(batch, agg_settings))
        except AssertionError:
            return True
        return False

    # Only generation: the first violating batch is enough, shrinking it would only cost time.
    no_shrinking = settings(max_examples=2000, database=None, phases=[Phase.generate])
    find(st.tuples(rollout_batches(), aggregation_settings()), violates, settings=no_shrinking)
