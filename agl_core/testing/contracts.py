"""Contract suites: the invariants every plugin of a kind must keep, as base test classes.

Test an aggregator by subclassing :class:`AggregatorContract` in a ``test_*.py`` file::

    from agl_core.testing.contracts import AggregatorContract

    class TestMyAggregator(AggregatorContract):
        aggregator_name = "my_aggregator"

The aggregator is looked up by name in a plugin manager holding the built-ins and installed entry
points (group ``agl``); list plugin objects in ``plugins`` to register them in code instead. Each
test draws batches of traces from :mod:`agl_core.testing.strategies`; the active hypothesis
profile sets how many (100 per test by default).

The invariants, for every rollout of a batch:

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
- the metrics count what the rows show; the input is not mutated; the output is deterministic.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from agl_core.testing import hypothesis_missing

try:
    from hypothesis import HealthCheck, given, settings
except ModuleNotFoundError as exc:
    raise hypothesis_missing(__name__) from exc

from agl_core.stages.aggregation import MISMATCH_KINDS, Aggregation, AggregationSettings
from agl_core.data import CompletedRollout, DataValidationError, TrainingRow, Triplet
from agl_core.plugins import PluginManager
from agl_core.testing.strategies import TOY_TOKENIZER, aggregation_settings, rollout_batches

__all__ = ["AggregatorContract", "check_aggregation"]

_given_batch = given(batch=rollout_batches(), agg_settings=aggregation_settings())
# One test method runs for every subclass (every aggregator): that is the point of a contract.
_hypothesis = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.differing_executors],
)


def _fail(message: str, row: TrainingRow | None = None) -> None:
    where = f" (rollout {row.rollout_id!r}, row starting at call {row.turn_index})" if row is not None else ""
    raise AssertionError(message + where)


class _RowView:
    """What the contract needs to know about one row, against the calls it merged."""

    def __init__(self, row: TrainingRow, rollout: CompletedRollout, agg_settings: AggregationSettings):
        self.row = row
        calls = rollout.triplets
        first, n_merged = row.turn_index, len(row.turn_rewards)
        if n_merged < 1 or first + n_merged > len(calls):
            _fail(f"turn_index {first} with {n_merged} turn_rewards does not fit the {len(calls)} calls", row)
        self.calls = range(first, first + n_merged)
        self.last = calls[first + n_merged - 1]
        if row.response_turns is None:
            _fail("response_turns is None; every aggregator must fill it", row)
        self.at_limit = len(row.response_ids) == agg_settings.max_response_length
        # Checking each merged call also finds whether the row lost trained tokens to truncation.
        self.short = False
        for j in self.calls:
            self._check_call(j, calls[j])

    def _check_call(self, j: int, call: Any) -> None:
        row = self.row
        here = row.response_turns == j
        mask = row.response_mask[here]
        if mask.size and np.any(np.diff(mask.astype(np.int8)) < 0):
            _fail(f"call {j}: an observation token follows a trained token of the same call", row)
        if j == row.turn_index and mask.size and mask[0] == 0:
            _fail(f"call {j}: the first merged call has observation tokens in the response", row)
        trained_ids = row.response_ids[here][mask == 1]
        n = len(trained_ids)
        if not np.array_equal(trained_ids, call.response_ids[:n]):
            _fail(f"call {j}: trained tokens are not the call's response tokens in order", row)
        if n < len(call.response_ids):
            later = row.response_turns[row.response_turns > j]
            if not (self.at_limit and not row.dropped and later.size == 0):
                _fail(f"call {j}: {len(call.response_ids) - n} response tokens missing without truncation", row)
            self.short = True
        if row.log_probs is not None:
            if call.response_log_probs is None:
                _fail(f"call {j} has no log-probs but the row keeps log-probs", row)
            lp = row.log_probs[here]
            if not np.all(lp[mask == 0] == 0):
                _fail(f"call {j}: observation tokens carry non-zero log-probs", row)
            if not np.array_equal(lp[mask == 1], call.response_log_probs[:n]):
                _fail(f"call {j}: log-probs are not the call's, in order", row)


def _views(rollouts: Sequence[CompletedRollout], result: Aggregation, agg_settings: AggregationSettings):
    by_id = {r.rollout_id: r for r in rollouts}
    views: dict[str, list[_RowView]] = {r.rollout_id: [] for r in rollouts}
    for row in result.rows:
        if not isinstance(row, TrainingRow):
            _fail(f"rows must be TrainingRow objects, got {type(row).__name__}")
        rollout = by_id.get(row.rollout_id)
        if rollout is None:
            _fail(f"row names rollout {row.rollout_id!r}, which is not in the input")
        views[row.rollout_id].append(_RowView(row, rollout, agg_settings))
    return by_id, views


def check_identity(rollouts, result, agg_settings) -> None:
    by_id, views = _views(rollouts, result, agg_settings)
    for rollout_id, rows in views.items():
        rollout = by_id[rollout_id]
        for view in rows:
            row = view.row
            if row.group_id != rollout.group_id:
                _fail(f"group_id {row.group_id!r} is not the rollout's {rollout.group_id!r}", row)
            if row.reward != rollout.final_reward:
                _fail(f"reward {row.reward} is not the rollout's final reward {rollout.final_reward}", row)
            expected = tuple(rollout.triplets[j].reward for j in view.calls)
            if row.turn_rewards != expected:
                _fail(f"turn_rewards {row.turn_rewards} are not the merged calls' rewards {expected}", row)
        covered = sorted(j for view in rows for j in view.calls)
        if len(covered) != len(set(covered)):
            _fail(f"rollout {rollout_id!r}: a call is merged into two rows")


def check_tokens(rollouts, result, agg_settings) -> None:
    by_id, views = _views(rollouts, result, agg_settings)
    for rollout_id, rows in views.items():
        calls = by_id[rollout_id].triplets
        for view in rows:
            row = view.row
            if not row.response_mask.any():
                _fail("row has no trained token; it should have been skipped and counted", row)
            merged_have_log_probs = all(calls[j].response_log_probs is not None for j in view.calls)
            if merged_have_log_probs and row.log_probs is None:
                _fail("every merged call has log-probs but the row dropped them", row)
            if row.dropped:
                if len(row.prompt_ids) <= agg_settings.max_prompt_length:
                    _fail(f"row marked dropped with a prompt of {len(row.prompt_ids)} tokens, within the limit", row)
                continue
            if len(row.prompt_ids) > agg_settings.max_prompt_length:
                _fail(f"prompt of {len(row.prompt_ids)} tokens over the limit but the row is not dropped", row)
            if len(row.response_ids) > agg_settings.max_response_length:
                _fail(f"response of {len(row.response_ids)} tokens over the limit", row)


def _decode(ids: np.ndarray, tokenizer: Any) -> str:
    return tokenizer.decode([int(i) for i in ids])


def check_context(rollouts, result, agg_settings, exact_token_context: bool = True) -> None:
    by_id, views = _views(rollouts, result, agg_settings)
    tokenizer = agg_settings.tokenizer
    for rollout_id, rows in views.items():
        calls = by_id[rollout_id].triplets
        for view in rows:
            row = view.row
            if row.dropped:
                continue
            got = np.concatenate([row.prompt_ids, row.response_ids])
            want = np.concatenate([view.last.prompt_ids, view.last.response_ids])
            if exact_token_context or tokenizer is None:
                if not np.array_equal(row.prompt_ids, calls[row.turn_index].prompt_ids):
                    _fail("the row's prompt is not its first call's prompt", row)
                ok = np.array_equal(got, want[: len(got)]) and (len(got) == len(want) or view.at_limit)
                what = "ids"
            else:
                got_text, want_text = _decode(got, tokenizer), _decode(want, tokenizer)
                ok = got_text == want_text or (view.at_limit and want_text.startswith(got_text))
                what = "decoded text"
            if not ok:
                _fail(f"prompt + response ({what}) is not the last merged call's prompt + response", row)


def _missing_runs(n_calls: int, covered: set[int]) -> tuple[int, int]:
    """(runs of consecutive calls in no row, calls in no row)."""
    missing = [j for j in range(n_calls) if j not in covered]
    runs = sum(1 for k, j in enumerate(missing) if k == 0 or missing[k - 1] != j - 1)
    return runs, len(missing)


def check_metrics(rollouts, result, agg_settings, exact_token_context: bool = True) -> None:
    by_id, views = _views(rollouts, result, agg_settings)
    metrics = result.metrics
    for name in (
        "training/n_sample_dropped/marked",
        "training/n_truncated_sample",
        "training/n_skipped_empty_rows",
        "training/n_turns",
    ):
        if name not in metrics:
            _fail(f"metric {name!r} is missing")
    kept = [view for rows in views.values() for view in rows if not view.row.dropped]
    n_dropped = sum(view.row.dropped for rows in views.values() for view in rows)
    if metrics["training/n_sample_dropped/marked"] != n_dropped:
        _fail(f"training/n_sample_dropped/marked is {metrics['training/n_sample_dropped/marked']}, {n_dropped} rows are dropped")

    truncated = metrics["training/n_truncated_sample"]
    if exact_token_context:
        cut = sum(
            len(v.row.prompt_ids) + len(v.row.response_ids) < len(v.last.prompt_ids) + len(v.last.response_ids)
            for v in kept
        )
        if truncated != cut:
            _fail(f"training/n_truncated_sample is {truncated}, {cut} rows are cut short")
    else:
        low, high = sum(v.short for v in kept), sum(v.at_limit for v in kept)
        if not low <= truncated <= high:
            _fail(f"training/n_truncated_sample is {truncated}, expected between {low} and {high}")

    runs = missing = 0
    for rollout_id, rows in views.items():
        r, m = _missing_runs(len(by_id[rollout_id].triplets), {j for view in rows for j in view.calls})
        runs, missing = runs + r, missing + m
    skipped = metrics["training/n_skipped_empty_rows"]
    if not runs <= skipped <= missing:
        _fail(f"training/n_skipped_empty_rows is {skipped}; {missing} calls in {runs} runs are in no row")

    lengths = [len(t.response_ids) for r in rollouts for t in r.triplets]
    if metrics["training/n_turns"] != len(lengths):
        _fail(f"training/n_turns is {metrics['training/n_turns']}, the batch has {len(lengths)} calls")
    if lengths:
        for stat, value in (("avg", np.mean(lengths)), ("max", max(lengths)), ("min", min(lengths))):
            name = f"response_length/training/{stat}_by_turn"
            if name in metrics and not np.isclose(metrics[name], value):
                _fail(f"{name} is {metrics[name]}, the calls give {value}")

    _check_mismatch_metrics(rollouts, result, agg_settings, views)


def _check_mismatch_metrics(rollouts, result, agg_settings, views) -> None:
    metrics = result.metrics
    if len(result.mismatches) > agg_settings.mismatch_sample_size:
        _fail(f"{len(result.mismatches)} mismatches kept, the sample size is {agg_settings.mismatch_sample_size}")
    breaks = metrics.get("training/n_trace_merge_mismatch_rows")
    if breaks is None:
        if result.mismatches:
            _fail("mismatches are returned but training/n_trace_merge_mismatch_rows is not reported")
        return
    by_class = [metrics.get(f"training/trace_merge_mismatch/{kind}", 0.0) for kind in MISMATCH_KINDS]
    if sum(by_class) != breaks:
        _fail(f"per-class mismatch counts {by_class} do not add up to {breaks}")
    low = sum(max(len(rows) - 1, 0) for rows in views.values())
    high = sum(max(len(r.triplets) - 1, 0) for r in rollouts)
    if not low <= breaks <= high:
        _fail(f"training/n_trace_merge_mismatch_rows is {breaks}, expected between {low} and {high}")
    for kind, count in zip(MISMATCH_KINDS, by_class):
        if sum(m.kind == kind for m in result.mismatches) > count:
            _fail(f"more {kind} mismatches sampled than counted ({count})")
    for m in result.mismatches:
        if len(m.context_ids) > agg_settings.mismatch_max_length or len(m.prompt_ids) > agg_settings.mismatch_max_length:
            _fail(f"mismatch sample of rollout {m.rollout_id!r} keeps more ids than mismatch_max_length")
        for text in (m.context_text, m.prompt_text):
            if text is not None and len(text) > agg_settings.mismatch_max_length:
                _fail(f"mismatch sample of rollout {m.rollout_id!r} keeps more text than mismatch_max_length")
    unmerged = metrics.get("training/n_unmerged_rollouts")
    if unmerged is not None:
        low = sum(len(rows) > 1 for rows in views.values())
        high = min(breaks, sum(len(r.triplets) > 1 for r in rollouts))
        if not low <= unmerged <= high:
            _fail(f"training/n_unmerged_rollouts is {unmerged}, expected between {low} and {high}")


def check_aggregation(
    rollouts: Sequence[CompletedRollout],
    agg_settings: AggregationSettings,
    result: Aggregation,
    exact_token_context: bool = True,
) -> None:
    """Every invariant of the contract on one result (for property tests of one's own)."""
    if not isinstance(result, Aggregation):
        _fail(f"an aggregator must return an Aggregation, got {type(result).__name__}")
    check_identity(rollouts, result, agg_settings)
    check_tokens(rollouts, result, agg_settings)
    check_context(rollouts, result, agg_settings, exact_token_context)
    check_metrics(rollouts, result, agg_settings, exact_token_context)


_AGGREGATORS: dict[type, Callable[..., Any]] = {}


class AggregatorContract:
    """Base test class: subclass it, set ``aggregator_name``, and pytest runs the contract."""

    aggregator_name: ClassVar[str] = ""
    #: plugin objects to register in code; by default the aggregator is found among the
    #: built-ins and installed entry points.
    plugins: ClassVar[tuple[Any, ...]] = ()
    #: False for an aggregator that merges across retokenization: rows then match the last
    #: merged call on decoded text (with the tokenizer of the settings) rather than on ids.
    exact_token_context: ClassVar[bool] = True

    def aggregate(self, rollouts: Sequence[CompletedRollout], agg_settings: AggregationSettings) -> Aggregation:
        cls = type(self)
        if cls not in _AGGREGATORS:
            if not cls.aggregator_name:
                raise TypeError(f"{cls.__name__} must set aggregator_name to the aggregator under test")
            manager = PluginManager()
            for plugin in cls.plugins:
                manager.register(plugin)
            _AGGREGATORS[cls] = manager.aggregators.get(cls.aggregator_name)
        result = _AGGREGATORS[cls](rollouts, agg_settings)
        if not isinstance(result, Aggregation):
            _fail(f"aggregator {cls.aggregator_name!r} returned {type(result).__name__}, not an Aggregation")
        return result

    @_given_batch
    @_hypothesis
    def test_rows_carry_their_rollout(self, batch, agg_settings):
        check_identity(batch, self.aggregate(batch, agg_settings), agg_settings)

    @_given_batch
    @_hypothesis
    def test_model_tokens_trained_once_observations_never(self, batch, agg_settings):
        check_tokens(batch, self.aggregate(batch, agg_settings), agg_settings)

    @_given_batch
    @_hypothesis
    def test_row_is_the_last_merged_call(self, batch, agg_settings):
        check_context(batch, self.aggregate(batch, agg_settings), agg_settings, self.exact_token_context)

    @_given_batch
    @_hypothesis
    def test_metrics_count_the_rows(self, batch, agg_settings):
        check_metrics(batch, self.aggregate(batch, agg_settings), agg_settings, self.exact_token_context)

    @_given_batch
    @_hypothesis
    def test_input_is_not_mutated(self, batch, agg_settings):
        before = [copy.deepcopy(r.to_dict()) for r in batch]
        self.aggregate(batch, agg_settings)
        assert [r.to_dict() for r in batch] == before, "the aggregator changed its input rollouts"

    @_given_batch
    @_hypothesis
    def test_output_is_deterministic(self, batch, agg_settings):
        first, second = self.aggregate(batch, agg_settings), self.aggregate(batch, agg_settings)
        assert first.rows == second.rows, "two runs on the same input gave different rows"
        assert first.metrics == second.metrics, "two runs on the same input gave different metrics"
        assert first.mismatches == second.mismatches, "two runs on the same input gave different mismatches"

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
