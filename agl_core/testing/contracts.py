"""Contract suites: the invariants every plugin of a kind must keep, as base test classes.

Test an aggregator by subclassing :class:`AggregatorContract` in a ``test_*.py`` file::

    import my_package
    from agl_core.testing.contracts import AggregatorContract

    class TestMyAggregator(AggregatorContract):
        aggregator_name = "my_aggregator"
        plugins = (my_package,)

The aggregator is looked up by name in a plugin manager holding the built-ins and the objects in
``plugins``; installed entry points are never loaded (:mod:`agl_core.testing.lookup`), so the
contract tests the code in front of it. Each test draws batches of traces from
:mod:`agl_core.testing.strategies` (uuid rollout and group ids, in random order); the active
hypothesis profile sets how many (100 per test by default, 1,000 under ``agl-thorough``).

The invariants, for every rollout of a batch (:mod:`agl_core.testing.aggregator_checks`):

- every row names an input rollout and carries its group id and final reward; the calls a row
  merges are consecutive (``turn_index`` and ``len(turn_rewards)``), each call in at most one row;
- every model-generated token of a kept call is trained exactly once, in order, preceded by that
  call's untrained observation; only truncation (a row cut at ``max_response_length``, counted) or
  a row without any trained token (skipped, counted) loses tokens; observation tokens are never
  trained; log-probs are kept exactly when every merged call has them, 0 on observations;
- a row's prompt + response is the last merged call's prompt + response (a prefix when truncated);
  an aggregator that re-aligns merged calls on text sets ``exact_token_context = False`` and is
  held to the same on decoded text;
- prompts over ``max_prompt_length`` mark the row dropped; other rows fit both limits;
- the metrics count what the rows show; a call in no row is in a skipped row
  (``training/n_skipped_empty_rows``) or, for an aggregator that sets ``leaves_calls_out = True``,
  counted in ``training/n_calls_left_out`` (:meth:`~agl_core.stages.aggregation.AggregationCounts.leave_out`);
- the input is not mutated (nor reordered); the output is deterministic;
- for an aggregator that trains only some calls on purpose (a window of the last K, the last
  call...), ``trained_calls(rollout, settings)`` declares which: exactly those calls are in rows
  (a call with an empty response may be in none).

Reference mode: ``reference`` is a slow, obviously-correct aggregator (same signature); its rows
(sorted by rollout and first call) and metrics are compared with the plugin's on every batch.

The suites for advantage estimators (:class:`AdvantageEstimatorContract`, in
:mod:`agl_core.testing.estimator_contract`), policy losses (:class:`PolicyLossContract`, in
:mod:`agl_core.testing.loss_contract`) and backends (:class:`BackendContract`, in
:mod:`agl_core.testing.backend_contract`) are importable from here too.
"""

from __future__ import annotations

from agl_core.testing import hypothesis_missing

try:
    from hypothesis import given
except ModuleNotFoundError as exc:
    raise hypothesis_missing(__name__) from exc

from collections.abc import Sequence
from typing import Any, ClassVar

import pytest

from agl_core.data import CompletedRollout, DataValidationError, Triplet
from agl_core.stages.aggregation import Aggregation, AggregationSettings
from agl_core.testing.aggregator_checks import (
    check_aggregation,
    check_context,
    check_identity,
    check_metrics,
    check_tokens,
)
from agl_core.testing.backend_contract import BackendContract
from agl_core.testing.estimator_contract import AdvantageEstimatorContract
from agl_core.testing.hook_contract import HookContract
from agl_core.testing.lookup import PluginContract
from agl_core.testing.loss_contract import PolicyLossContract
from agl_core.testing.reference import mapping_diff
from agl_core.testing.sink_contract import MetricSinkContract
from agl_core.testing.snapshots import describe_change, snapshot
from agl_core.testing.strategies import CONTRACT_SETTINGS, TOY_TOKENIZER, aggregation_settings, rollout_batches

__all__ = [
    "AdvantageEstimatorContract",
    "AggregatorContract",
    "BackendContract",
    "HookContract",
    "MetricSinkContract",
    "PolicyLossContract",
    "check_aggregation",
    "check_input_unchanged",
    "check_matches_reference",
    "check_trained_calls",
]

_given_batch = given(batch=rollout_batches(), agg_settings=aggregation_settings())


def check_input_unchanged(before: list[Any], after: list[Any], plugin: str) -> None:
    """Fail, saying what changed, when snapshot ``after`` of the rollouts differs from ``before``."""
    change = describe_change(before, after, "rollouts", "rollout_id")
    if change:
        raise AssertionError(f"{plugin} changed its input: {change}")


def check_trained_calls(
    rollouts: Sequence[CompletedRollout], result: Aggregation, agg_settings: AggregationSettings, trained_calls: Any
) -> None:
    """Exactly the calls ``trained_calls(rollout, settings)`` declares are in rows (a call with an
    empty response may be in none: its row had nothing to train; nor may one whose own prompt fills
    ``max_total_length``: no row has room for its response)."""
    in_rows: dict[str, set[int]] = {r.rollout_id: set() for r in rollouts}
    for row in result.rows:
        in_rows.setdefault(row.rollout_id, set()).update(range(row.turn_index, row.turn_index + len(row.turn_rewards)))
    for rollout in rollouts:
        declared = set(trained_calls(rollout, agg_settings))
        got = in_rows[rollout.rollout_id]
        extra = sorted(got - declared)
        missing = sorted(
            j
            for j in declared - got
            if len(rollout.triplets[j].response_ids)
            and agg_settings.response_limit(len(rollout.triplets[j].prompt_ids)) > 0
        )
        if extra or missing:
            raise AssertionError(
                f"rollout {rollout.rollout_id!r} ({len(rollout.triplets)} calls): "
                f"the rows train calls {sorted(got)}, the "
                f"declaration (trained_calls) says {sorted(declared)}"
                + (f"; calls {extra} should be in no row" if extra else "")
                + (f"; calls {missing} should be trained" if missing else "")
            )


def _row_order(result: Aggregation) -> list[Any]:
    return sorted(result.rows, key=lambda row: (row.rollout_id, row.turn_index))


def check_matches_reference(batch: Sequence[CompletedRollout], result: Aggregation, want: Aggregation) -> None:
    """The rows (by rollout and first call) and the metrics equal the reference aggregator's."""
    got_rows, want_rows = snapshot(_row_order(result)), snapshot(_row_order(want))
    change = describe_change(want_rows, got_rows, "rows", "rollout_id")
    if change:
        raise AssertionError(
            f"the rows differ from the reference's ('was' is the reference, 'now' the plugin): {change}"
        )
    diff = mapping_diff(result.metrics, want.metrics, keys=sorted(want.metrics))
    if diff:
        raise AssertionError(f"the metrics differ from the reference's:\n{diff}")


class AggregatorContract(PluginContract):
    """Base test class: subclass it, set ``aggregator_name`` (and ``plugins``), and pytest runs the contract."""

    registry, name_attribute = "aggregators", "aggregator_name"
    aggregator_name: ClassVar[str] = ""
    #: False for an aggregator that merges across retokenization: rows then match the last
    #: merged call on decoded text (with the tokenizer of the settings) rather than on ids.
    exact_token_context: ClassVar[bool] = True
    #: True for an aggregator that leaves some calls out of every row on purpose (e.g. trains only
    #: the last call); it counts them with ``AggregationCounts.leave_out``.
    leaves_calls_out: ClassVar[bool] = False
    #: for an aggregator that trains only some calls: ``trained_calls(rollout, settings)`` -> the
    #: indices of the calls it must train (e.g. the last K).
    trained_calls: ClassVar[Any] = None
    #: a slow, obviously-correct aggregator to compare with on every generated batch.
    reference: ClassVar[Any] = None

    def aggregate(self, rollouts: Sequence[CompletedRollout], agg_settings: AggregationSettings) -> Aggregation:
        result = self.plugin_under_test()(rollouts, agg_settings)
        if not isinstance(result, Aggregation):
            raise AssertionError(
                f"aggregator {self.aggregator_name!r} returned {type(result).__name__}, not an Aggregation"
            )
        return result

    @_given_batch
    @CONTRACT_SETTINGS
    def test_rows_carry_their_rollout(self, batch, agg_settings):
        check_identity(batch, self.aggregate(batch, agg_settings), agg_settings)

    @_given_batch
    @CONTRACT_SETTINGS
    def test_model_tokens_trained_once_observations_never(self, batch, agg_settings):
        check_tokens(batch, self.aggregate(batch, agg_settings), agg_settings)

    @_given_batch
    @CONTRACT_SETTINGS
    def test_row_is_the_last_merged_call(self, batch, agg_settings):
        check_context(batch, self.aggregate(batch, agg_settings), agg_settings, self.exact_token_context)

    @_given_batch
    @CONTRACT_SETTINGS
    def test_metrics_count_the_rows(self, batch, agg_settings):
        result = self.aggregate(batch, agg_settings)
        check_metrics(batch, result, agg_settings, self.exact_token_context, self.leaves_calls_out)

    @_given_batch
    @CONTRACT_SETTINGS
    def test_input_is_not_mutated(self, batch, agg_settings):
        before = snapshot(batch)
        self.aggregate(batch, agg_settings)
        check_input_unchanged(before, snapshot(batch), f"aggregator {self.aggregator_name!r}")

    @_given_batch
    @CONTRACT_SETTINGS
    def test_output_is_deterministic(self, batch, agg_settings):
        first, second = self.aggregate(list(batch), agg_settings), self.aggregate(list(batch), agg_settings)
        assert first.rows == second.rows, "two runs on the same input gave different rows"
        assert first.metrics == second.metrics, "two runs on the same input gave different metrics"
        assert first.mismatches == second.mismatches, "two runs on the same input gave different mismatches"

    @_given_batch
    @CONTRACT_SETTINGS
    def test_exactly_the_declared_calls_are_trained(self, batch, agg_settings):
        if type(self).trained_calls is None:
            pytest.skip("the aggregator declares no trained_calls (it trains every call)")
        check_trained_calls(batch, self.aggregate(batch, agg_settings), agg_settings, type(self).trained_calls)

    @_given_batch
    @CONTRACT_SETTINGS
    def test_matches_the_reference(self, batch, agg_settings):
        if type(self).reference is None:
            pytest.skip("no reference aggregator given (reference = None)")
        check_matches_reference(batch, self.aggregate(batch, agg_settings), type(self).reference(batch, agg_settings))

    def test_refuses_a_rollout_without_final_reward(self):
        """A missing reward must be filled before aggregation, never trained on as something else."""
        rollout = CompletedRollout(
            rollout_id="no-reward",
            group_id="g",
            state="succeeded",
            triplets=[Triplet(prompt_ids=[1, 2], response_ids=[3])],
            final_reward=None,
        )
        settings_ = AggregationSettings(max_prompt_length=8, max_response_length=8, tokenizer=TOY_TOKENIZER)
        with pytest.raises(DataValidationError) as err:
            self.aggregate([rollout], settings_)
        assert (err.value.rollout_id, err.value.field) == ("no-reward", "final_reward")
