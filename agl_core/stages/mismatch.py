"""Why a trajectory broke: classify each break and keep a bounded sample for inspection.

A break is a call whose prompt ids do not start with the context (the previous call's prompt +
response). Decoding both with the tokenizer tells three causes apart:

- ``retokenization``: the context's text is a prefix of the new prompt's text, only the ids
  differ (the model emitted a tokenization the tokenizer would not produce, and the agent's
  re-rendered history was tokenized afresh);
- ``template``: the previous prompt's text is still a prefix of the new prompt's text, but the
  previous response no longer follows it verbatim: the chat template re-rendered that turn
  (stripped reasoning, reformatted a tool call...);
- ``other``: anything else (history rewritten or truncated, a new conversation), and every break
  when no tokenizer is given.

A break of kind ``images`` (the call's images do not start with the previous call's: an image of
the history edited or removed) is named by the aggregator, whatever the ids say.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from agl_core.data import CompletedRollout, Triplet
from agl_core.stages.aggregation import AggregationCounts, AggregationSettings, Mismatch

__all__ = ["MismatchLog", "classify_break", "common_prefix_length", "decode"]

# Characters of shared text kept before the first difference, so a sample shows where it happened.
_TEXT_LEAD = 32


def decode(tokenizer: Any, ids: np.ndarray) -> str:
    return tokenizer.decode([int(i) for i in ids])


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = a[:n] != b[:n]
    return int(np.argmax(differ)) if differ.any() else n


def _classify(previous: Triplet, prompt_ids: np.ndarray, tokenizer: Any) -> tuple[str, tuple[str, str] | None]:
    """The kind of the break and, with a tokenizer, the decoded context and prompt."""
    if tokenizer is None:
        return "other", None
    context_text = decode(tokenizer, np.concatenate([previous.prompt_ids, previous.response_ids]))
    prompt_text = decode(tokenizer, prompt_ids)
    if prompt_text.startswith(context_text):
        kind = "retokenization"
    elif prompt_text.startswith(decode(tokenizer, previous.prompt_ids)):
        kind = "template"
    else:
        kind = "other"
    return kind, (context_text, prompt_text)


def classify_break(previous: Triplet, prompt_ids: np.ndarray, tokenizer: Any) -> str:
    """The cause of a break between call ``previous`` and the next call's ``prompt_ids``."""
    return _classify(previous, prompt_ids, tokenizer)[0]


class MismatchLog:
    """Classifies and counts every break of a batch; keeps the first ``mismatch_sample_size``."""

    def __init__(self, settings: AggregationSettings, counts: AggregationCounts):
        self.settings = settings
        self.counts = counts
        self.sample: list[Mismatch] = []

    def record(
        self,
        rollout: CompletedRollout,
        turn_index: int,
        previous: Triplet,
        prompt_ids: np.ndarray,
        *,
        kind: str | None = None,
    ) -> str:
        """Count the break before call ``turn_index`` of ``rollout``; return its kind (``kind`` when
        given, as ``images`` is, else the ids' classification)."""
        classified, texts = _classify(previous, prompt_ids, self.settings.tokenizer)
        kind = kind or classified
        context = np.concatenate([previous.prompt_ids, previous.response_ids])
        self.counts.merge_break(kind)
        if len(self.sample) < self.settings.mismatch_sample_size:
            self.sample.append(self._describe(rollout, turn_index, kind, context, prompt_ids, texts))
        return kind

    def _describe(
        self,
        rollout: CompletedRollout,
        turn_index: int,
        kind: str,
        context: np.ndarray,
        prompt_ids: np.ndarray,
        texts: tuple[str, str] | None,
    ) -> Mismatch:
        limit = self.settings.mismatch_max_length
        common = common_prefix_length(context, prompt_ids)
        text_fields: dict[str, Any] = {}
        if texts is not None:
            context_text, prompt_text = texts
            offset = max(0, len(os.path.commonprefix([context_text, prompt_text])) - _TEXT_LEAD)
            text_fields = {
                "text_offset": offset,
                "context_text": context_text[offset : offset + limit],
                "prompt_text": prompt_text[offset : offset + limit],
            }
        return Mismatch(
            rollout_id=rollout.rollout_id,
            group_id=rollout.group_id,
            turn_index=turn_index,
            kind=kind,
            context_length=len(context),
            prompt_length=len(prompt_ids),
            common_prefix_length=common,
            context_ids=tuple(context[common : common + limit].tolist()),
            prompt_ids=tuple(prompt_ids[common : common + limit].tolist()),
            **text_fields,
        )
