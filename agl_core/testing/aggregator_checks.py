"""The aggregator contract's invariants, as functions of (input rollouts, result, settings).

Each ``check_*`` raises ``AssertionError`` with a message that names the rollout and the row, and
says what the row holds and what it should have held.
:class:`~agl_core.testing.contracts.AggregatorContract` runs them on generated batches; call them
directly in property tests of your own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from agl_core.data import CompletedRollout, TrainingRow
from agl_core.stages.aggregation import (
    CALLS_LEFT_OUT_METRIC,
    MISMATCH_KINDS,
    TOTAL_LENGTH_CUT_METRIC,
    Aggregation,
    AggregationSettings,
)
from agl_core.stages.mismatch import common_prefix_length
from agl_core.testing.snapshots import shorten

__all__ = [
    "check_aggregation",
    "check_context",
    "check_identity",
    "check_metrics",
    "check_tokens",
]

_SHOWN = 12  # ids shown around a difference


def _fail(message: str, row: TrainingRow | None = None) -> None:
    where = f" (rollout {row.rollout_id!r}, row starting at call {row.turn_index})" if row is not None else ""
    raise AssertionError(message + where)


def _around(ids: np.ndarray, at: int) -> str:
    """The ids from ``at`` on, shortened, marked as a tail when ``at`` > 0."""
    return ("…" if at else "") + shorten(ids[at : at + _SHOWN])


class _RowView:
    """What the contract needs to know about one row, against the calls it merged."""

    def __init__(self, row: TrainingRow, rollout: CompletedRollout, agg_settings: AggregationSettings):
        self.row = row
        # max_response_length, or less where the prompt leaves less room under max_total_length
        self.limit = agg_settings.response_limit(len(row.prompt_ids))
        self.total_cut = self.limit < agg_settings.max_response_length
        calls = rollout.triplets
        first, n_merged = row.turn_index, len(row.turn_rewards)
        if n_merged < 1 or first + n_merged > len(calls):
            _fail(
                f"turn_index {first} with {n_merged} turn_rewards does not fit the rollout's {len(calls)} calls: "
                f"a row names the first call it merges and holds one turn reward per merged call",
                row,
            )
        self.calls = range(first, first + n_merged)
        self.last = calls[first + n_merged - 1]
        if row.response_turns is None:
            _fail("response_turns is None; every aggregator must give each response token the index of its call", row)
        self.at_limit = len(row.response_ids) == self.limit
        # Checking each merged call also finds whether the row lost trained tokens to truncation.
        self.short = False
        for j in self.calls:
            self._check_call(j, calls[j])

    def _check_call(self, j: int, call: Any) -> None:
        row = self.row
        here = row.response_turns == j
        mask = row.response_mask[here]
        if mask.size and np.any(np.diff(mask.astype(np.int8)) < 0):
            _fail(
                f"call {j}: its tokens must be its observation (mask 0) then its response (mask 1); the mask is "
                f"{shorten(mask)}",
                row,
            )
        if j == row.turn_index and mask.size and mask[0] == 0:
            _fail(
                f"call {j}: the first merged call's observation belongs to the prompt, yet the response starts with "
                f"mask {shorten(mask)}",
                row,
            )
        trained_ids = row.response_ids[here][mask == 1]
        n = len(trained_ids)
        if not np.array_equal(trained_ids, call.response_ids[:n]):
            _fail(
                f"call {j}: trained tokens are {shorten(trained_ids)}, expected the call's response "
                f"{shorten(call.response_ids)}",
                row,
            )
        if n < len(call.response_ids):
            self._check_cut(j, len(call.response_ids) - n, len(call.response_ids))
        if row.log_probs is not None:
            if call.response_log_probs is None:
                _fail(f"call {j} has no log-probs, so the row's log_probs should be None", row)
            lp = row.log_probs[here]
            if not np.all(lp[mask == 0] == 0):
                _fail(f"call {j}: observation tokens carry log-probs {shorten(lp[mask == 0])}, expected 0", row)
            if not np.array_equal(lp[mask == 1], call.response_log_probs[:n]):
                _fail(
                    f"call {j}: log-probs are {shorten(lp[mask == 1])}, expected the call's "
                    f"{shorten(call.response_log_probs[:n])}",
                    row,
                )

    def _check_cut(self, j: int, missing: int, total: int) -> None:
        """Call ``j`` lost ``missing`` of its ``total`` response tokens: only a cut at the limit may do that."""
        row = self.row
        lost = f"call {j}: {missing} of its {total} response tokens are missing"
        later = row.response_turns[row.response_turns > j]
        if row.dropped:
            _fail(f"{lost} from a row marked dropped; a dropped row keeps every token", row)
        if later.size:
            _fail(f"{lost}, yet call {int(later[0])} follows it in the row; only the end of a row may be cut", row)
        if not self.at_limit:
            expected = min(len(row.response_ids) + missing, self.limit)
            _fail(
                f"{lost} and the row's response has {len(row.response_ids)} tokens: a row is cut only at "
                f"{self.limit_name} = {self.limit}, so it should have {expected} response tokens",
                row,
            )
        self.short = True

    @property
    def limit_name(self) -> str:
        return "max_total_length - prompt" if self.total_cut else "max_response_length"


def _views(rollouts: Sequence[CompletedRollout], result: Aggregation, agg_settings: AggregationSettings):
    by_id = {r.rollout_id: r for r in rollouts}
    views: dict[str, list[_RowView]] = {r.rollout_id: [] for r in rollouts}
    for row in result.rows:
        if not isinstance(row, TrainingRow):
            _fail(f"rows must be TrainingRow objects, got {type(row).__name__}")
        rollout = by_id.get(row.rollout_id)
        if rollout is None:
            _fail(f"row names rollout {row.rollout_id!r}, which is not in the input (ids: {shorten(sorted(by_id))})")
        views[row.rollout_id].append(_RowView(row, rollout, agg_settings))
    return by_id, views


def check_identity(rollouts, result, agg_settings) -> None:
    """Every row carries its rollout's group, final reward and merged calls' rewards; no call is in two rows."""
    by_id, views = _views(rollouts, result, agg_settings)
    for rollout_id, rows in views.items():
        rollout = by_id[rollout_id]
        for view in rows:
            row = view.row
            if row.group_id != rollout.group_id:
                _fail(f"group_id is {row.group_id!r}, expected the rollout's {rollout.group_id!r}", row)
            if row.reward != rollout.final_reward:
                _fail(f"reward is {row.reward}, expected the rollout's final reward {rollout.final_reward}", row)
            expected = tuple(rollout.triplets[j].reward for j in view.calls)
            if row.turn_rewards != expected:
                _fail(f"turn_rewards are {row.turn_rewards}, expected the merged calls' rewards {expected}", row)
        covered = sorted(j for view in rows for j in view.calls)
        twice = sorted({j for j in covered if covered.count(j) > 1})
        if twice:
            _fail(
                f"rollout {rollout_id!r}: calls {twice} are merged into more than one row; each call belongs to at "
                "most one row"
            )


def check_tokens(rollouts, result, agg_settings) -> None:
    """Each row trains something, keeps log-probs when it can, and is dropped exactly when its prompt is too long."""
    by_id, views = _views(rollouts, result, agg_settings)
    for rollout_id, rows in views.items():
        calls = by_id[rollout_id].triplets
        for view in rows:
            row = view.row
            if not row.response_mask.any():
                _fail(
                    "row has no trained token; it should have been skipped and counted in "
                    "training/n_skipped_empty_rows",
                    row,
                )
            merged_have_log_probs = all(calls[j].response_log_probs is not None for j in view.calls)
            if merged_have_log_probs and row.log_probs is None:
                _fail(
                    f"every merged call ({view.calls.start}..{view.calls.stop - 1}) has log-probs, so the row should "
                    "keep them",
                    row,
                )
            n_prompt = len(row.prompt_ids)
            if row.dropped:
                if n_prompt <= agg_settings.max_prompt_length:
                    _fail(
                        f"row marked dropped, but its {n_prompt}-token prompt is within max_prompt_length = "
                        f"{agg_settings.max_prompt_length}",
                        row,
                    )
                continue
            if n_prompt > agg_settings.max_prompt_length:
                _fail(
                    f"the {n_prompt}-token prompt is over max_prompt_length = {agg_settings.max_prompt_length}, so the "
                    "row should be marked dropped",
                    row,
                )
            if len(row.response_ids) > view.limit:
                _fail(
                    f"response of {len(row.response_ids)} tokens, expected it cut at {view.limit_name} = {view.limit}",
                    row,
                )


def check_context(rollouts, result, agg_settings, exact_token_context: bool = True) -> None:
    """A kept row's prompt + response is its last merged call's prompt + response (a prefix when cut)."""
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
                first_prompt = calls[row.turn_index].prompt_ids
                if not np.array_equal(row.prompt_ids, first_prompt):
                    at = common_prefix_length(row.prompt_ids, first_prompt)
                    _fail(
                        f"the row's prompt should be its first call's prompt: they differ from position {at} "
                        f"(row {_around(row.prompt_ids, at)}, expected {_around(first_prompt, at)})",
                        row,
                    )
                _check_ids_context(view, got, want)
            else:
                got_text, want_text = tokenizer.decode(got.tolist()), tokenizer.decode(want.tolist())
                if not (got_text == want_text or (view.at_limit and want_text.startswith(got_text))):
                    _fail(
                        f"prompt + response decodes to {shorten(got_text)}, expected the last merged call's "
                        f"{shorten(want_text)}",
                        row,
                    )


def _check_ids_context(view: _RowView, got: np.ndarray, want: np.ndarray) -> None:
    row = view.row
    at = common_prefix_length(got, want)
    if at < len(got):
        _fail(
            f"prompt + response should be the last merged call's prompt + response; they differ from id {at} "
            f"(row {_around(got, at)}, expected {_around(want, at)})",
            row,
        )
    if len(got) < len(want) and not view.at_limit:
        _fail(
            f"prompt + response is {len(got)} ids, the last merged call's {len(want)}: a row is shorter only when cut "
            f"at {view.limit_name} = {view.limit}, so it should have "
            f"{min(len(want) - len(row.prompt_ids), view.limit)} response ids",
            row,
        )


def _missing_runs(n_calls: int, covered: set[int]) -> tuple[int, int]:
    """(runs of consecutive calls in no row, calls in no row)."""
    missing = [j for j in range(n_calls) if j not in covered]
    runs = sum(1 for k, j in enumerate(missing) if k == 0 or missing[k - 1] != j - 1)
    return runs, len(missing)


def check_metrics(
    rollouts, result, agg_settings, exact_token_context: bool = True, leaves_calls_out: bool = False
) -> None:
    """The metrics count what the rows show: drops, truncations, skipped and left-out calls, calls, breaks."""
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
        _fail(
            f"training/n_sample_dropped/marked is {metrics['training/n_sample_dropped/marked']}, expected {n_dropped} "
            "(the rows marked dropped)"
        )

    truncated = metrics["training/n_truncated_sample"]
    if exact_token_context:
        cut = sum(
            len(v.row.prompt_ids) + len(v.row.response_ids) < len(v.last.prompt_ids) + len(v.last.response_ids)
            for v in kept
        )
        if truncated != cut:
            _fail(f"training/n_truncated_sample is {truncated}, expected {cut} (the kept rows cut short)")
    else:
        low, high = sum(v.short for v in kept), sum(v.at_limit for v in kept)
        if not low <= truncated <= high:
            _fail(f"training/n_truncated_sample is {truncated}, expected between {low} and {high}")
    _check_calls_in_no_row(by_id, views, metrics, leaves_calls_out)
    # Rows the total cap cut: at least the kept ones that lost trained tokens at its limit; at most
    # every kept row that ends at that limit (a cut may remove observation tokens only) and every
    # skipped row besides.
    by_total = metrics.get(TOTAL_LENGTH_CUT_METRIC, 0.0)
    low = sum(v.total_cut and v.short for v in kept)
    high = sum(v.total_cut and v.at_limit for v in kept) + metrics["training/n_skipped_empty_rows"]
    if not low <= by_total <= high:
        _fail(
            f"{TOTAL_LENGTH_CUT_METRIC} is {by_total}, expected between {low} (the kept rows that lost trained "
            f"tokens to max_total_length) and {high} (the kept rows ending at its limit, plus "
            "training/n_skipped_empty_rows)"
        )

    lengths = [len(t.response_ids) for r in rollouts for t in r.triplets]
    if metrics["training/n_turns"] != len(lengths):
        _fail(f"training/n_turns is {metrics['training/n_turns']}, expected {len(lengths)} (the calls in the batch)")
    if lengths:
        for stat, value in (("avg", np.mean(lengths)), ("max", max(lengths)), ("min", min(lengths))):
            name = f"response_length/training/{stat}_by_turn"
            if name in metrics and not np.isclose(metrics[name], value):
                _fail(f"{name} is {metrics[name]}, expected {value} from the calls")
    _check_mismatch_metrics(rollouts, result, agg_settings, views)


def _check_calls_in_no_row(by_id, views, metrics, leaves_calls_out: bool) -> None:
    """Every call in no row is in a skipped row (``n_skipped_empty_rows``: one per skipped row) or,
    for an aggregator that declares it, left out on purpose (``n_calls_left_out``: one per call)."""
    runs = missing = 0
    for rollout_id, rows in views.items():
        r, m = _missing_runs(len(by_id[rollout_id].triplets), {j for view in rows for j in view.calls})
        runs, missing = runs + r, missing + m
    left_out = metrics.get(CALLS_LEFT_OUT_METRIC, 0.0)
    if left_out and not leaves_calls_out:
        _fail(
            f"{CALLS_LEFT_OUT_METRIC} is {left_out}, but the aggregator does not declare that it leaves calls out "
            f"(set leaves_calls_out = True on its contract test)"
        )
    if not 0 <= left_out <= missing:
        _fail(f"{CALLS_LEFT_OUT_METRIC} is {left_out}, expected between 0 and {missing} (the calls in no row)")
    skipped = metrics["training/n_skipped_empty_rows"]
    # Leaving out k calls can remove at most k runs of calls in no row.
    low, high = max(runs - left_out, 0), missing - left_out
    if not low <= skipped <= high:
        explained = f"; {left_out:g} are counted in {CALLS_LEFT_OUT_METRIC}" if leaves_calls_out else ""
        _fail(
            f"training/n_skipped_empty_rows is {skipped}, expected between {low:g} and {high:g}: {missing} calls in "
            f"{runs} runs are in no row{explained}"
        )


def _check_mismatch_metrics(rollouts, result, agg_settings, views) -> None:
    metrics = result.metrics
    if len(result.mismatches) > agg_settings.mismatch_sample_size:
        _fail(
            f"{len(result.mismatches)} mismatches kept, expected at most mismatch_sample_size = "
            f"{agg_settings.mismatch_sample_size}"
        )
    breaks = metrics.get("training/n_trace_merge_mismatch_rows")
    if breaks is None:
        if result.mismatches:
            _fail("mismatches are returned but training/n_trace_merge_mismatch_rows is not reported")
        return
    by_class = [metrics.get(f"training/trace_merge_mismatch/{kind}", 0.0) for kind in MISMATCH_KINDS]
    if sum(by_class) != breaks:
        _fail(
            f"per-class mismatch counts {dict(zip(MISMATCH_KINDS, by_class))} should add up to "
            f"training/n_trace_merge_mismatch_rows = {breaks}"
        )
    low = sum(max(len(rows) - 1, 0) for rows in views.values())
    high = sum(max(len(r.triplets) - 1, 0) for r in rollouts)
    if not low <= breaks <= high:
        _fail(f"training/n_trace_merge_mismatch_rows is {breaks}, expected between {low} and {high}")
    for kind, count in zip(MISMATCH_KINDS, by_class):
        if sum(m.kind == kind for m in result.mismatches) > count:
            _fail(f"more {kind} mismatches sampled than counted ({count})")
    for m in result.mismatches:
        if (
            len(m.context_ids) > agg_settings.mismatch_max_length
            or len(m.prompt_ids) > agg_settings.mismatch_max_length
        ):
            _fail(
                f"mismatch sample of rollout {m.rollout_id!r} keeps more ids than mismatch_max_length = "
                f"{agg_settings.mismatch_max_length}"
            )
        for text in (m.context_text, m.prompt_text):
            if text is not None and len(text) > agg_settings.mismatch_max_length:
                _fail(
                    f"mismatch sample of rollout {m.rollout_id!r} keeps more text than mismatch_max_length = "
                    f"{agg_settings.mismatch_max_length}"
                )
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
    leaves_calls_out: bool = False,
) -> None:
    """Every invariant of the contract on one result (for property tests of one's own)."""
    if not isinstance(result, Aggregation):
        _fail(f"an aggregator must return an Aggregation, got {type(result).__name__}")
    check_identity(rollouts, result, agg_settings)
    check_tokens(rollouts, result, agg_settings)
    check_context(rollouts, result, agg_settings, exact_token_context)
    check_metrics(rollouts, result, agg_settings, exact_token_context, leaves_calls_out)
