"""``retoken_merge``: trajectory aggregation that also merges across retokenization mismatches.

When the next prompt does not start with the previous context id for id, decode the part after
their common prefix: if the new prompt has a token boundary where the context's text ends, the
context's own ids stand in for the new prompt's ids up to there, and the rest of the prompt is the
observation. Everything else (limits, counting, break classification) is agl's trajectory logic.

Its one setting, ``agentlightning.plugins.retoken_merge.lookahead_tokens`` (:class:`RetokenMergeSettings`),
bounds how many tokens past the first long-enough end are tried.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import numpy as np

from agl_core import (
    Aggregation,
    AggregationSettings,
    CompletedRollout,
    Triplet,
    aggregate_trajectories,
    common_prefix_length,
    exact_prefix,
    hookimpl,
)

__all__ = ["RetokenMergeSettings", "realigned_start", "retoken_merge"]

REALIGNED_METRIC = "training/n_realigned_merges"


@attrs.frozen
class RetokenMergeSettings:
    """``agentlightning.plugins.retoken_merge``: how far re-alignment searches."""

    #: tokens tried past the first end whose text is long enough: a multi-byte character may need
    #: several byte-level tokens to complete.
    lookahead_tokens: int = attrs.field(
        default=4, validator=attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.ge(0))
    )


def _decode(tokenizer, ids: np.ndarray) -> str:
    return tokenizer.decode(ids.tolist())


def realigned_start(context: np.ndarray, prompt_ids: np.ndarray, tokenizer, lookahead_tokens: int = 4) -> int | None:
    """The index in ``prompt_ids`` where the text of ``context`` ends, if a token boundary is there."""
    common = common_prefix_length(context, prompt_ids)
    tail = _decode(tokenizer, context[common:])
    if not tail:
        return common

    def text_length(end: int) -> int:
        return len(_decode(tokenizer, prompt_ids[common:end]))

    # Decoded length grows with the number of tokens: find the first end long enough, then look at
    # the next few ends (a multi-byte character may need more than one token to complete).
    low, high = common + 1, len(prompt_ids)
    if high < low or text_length(high) < len(tail):
        return None
    while low < high:
        middle = (low + high) // 2
        if text_length(middle) >= len(tail):
            high = middle
        else:
            low = middle + 1
    for end in range(low, min(low + lookahead_tokens, len(prompt_ids)) + 1):
        if _decode(tokenizer, prompt_ids[common:end]) == tail:
            return end
    return None


def retoken_merge(
    rollouts: Sequence[CompletedRollout], settings: AggregationSettings, lookahead_tokens: int = 4
) -> Aggregation:
    """Trajectory aggregation that re-aligns retokenized context on decoded text."""
    realigned = 0

    def align(previous: Triplet, prompt_ids: np.ndarray, settings: AggregationSettings) -> int | None:
        nonlocal realigned
        start = exact_prefix(previous, prompt_ids, settings)
        if start is not None or settings.tokenizer is None:
            return start
        context = np.concatenate([previous.prompt_ids, previous.response_ids])
        start = realigned_start(context, prompt_ids, settings.tokenizer, lookahead_tokens)
        if start is not None:
            realigned += 1
        return start

    result = aggregate_trajectories(rollouts, settings, align)
    return attrs.evolve(result, metrics={**result.metrics, REALIGNED_METRIC: float(realigned)})


@hookimpl
def agl_plugin_settings():
    return {"retoken_merge": RetokenMergeSettings}


@hookimpl
def agl_register_aggregators(register, settings):
    ours = settings["retoken_merge"]
    register("retoken_merge", functools.partial(retoken_merge, lookahead_tokens=ours.lookahead_tokens))
