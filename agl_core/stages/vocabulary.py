"""Calls with token ids outside the policy's vocabulary are never trained on.

The gateway records whatever the upstream server or the agent reported, so a call can carry ids the
tokenizer does not have (another model's ids, a corrupted post). Embedding such an id fails the
update (on a GPU as a device-side assert that takes the worker down), so the step pipeline removes
these calls from their rollouts before aggregation, on every backend, and counts them.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from agl_core.data import CompletedRollout, Triplet

__all__ = ["OUT_OF_VOCAB_METRIC", "within_vocabulary"]

OUT_OF_VOCAB_METRIC = "training/events/n_calls_out_of_vocab"


def _in_vocabulary(triplet: Triplet, vocab_size: int) -> bool:
    # Ids are validated non-negative int64 arrays, so only the largest matters.
    return all(not len(ids) or ids.max() < vocab_size for ids in (triplet.prompt_ids, triplet.response_ids))


def within_vocabulary(rollouts: Sequence[CompletedRollout], vocab_size: int) -> tuple[list[CompletedRollout], int]:
    """``rollouts`` without their calls whose prompt or response holds an id ``>= vocab_size``, and how
    many calls were removed. Rollouts without such a call are returned as they are."""
    kept, removed = [], 0
    for rollout in rollouts:
        triplets = [t for t in rollout.triplets if _in_vocabulary(t, vocab_size)]
        if len(triplets) == len(rollout.triplets):
            kept.append(rollout)
        else:
            removed += len(rollout.triplets) - len(triplets)
            kept.append(attrs.evolve(rollout, triplets=tuple(triplets)))
    return kept, removed
