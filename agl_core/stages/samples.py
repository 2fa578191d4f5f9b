"""The sample tables a training step reports for inspection: decoded rollouts and trajectory breaks.

``trajectories`` is Agent Lightning v1.0's rollout-trajectory sample: the first
:data:`TRAJECTORY_SAMPLE_SIZE` rollouts of the step that have model calls, in dataset order
(the step they were enqueued at, then their sample index), each with its final reward and the
decoded prompt and response of its last call (token ids joined by spaces without a tokenizer).
``mismatches`` holds the aggregator's bounded sample of trajectory breaks
(:class:`~agl_core.stages.aggregation.Mismatch`). Every row carries the training ``step``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agl_core.data import CompletedRollout
from agl_core.stages.aggregation import Mismatch

__all__ = ["TRAJECTORY_SAMPLE_SIZE", "step_samples", "trajectory_sample"]

TRAJECTORY_SAMPLE_SIZE = 24


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return " ".join(str(i) for i in ids)
    return tokenizer.decode(ids, skip_special_tokens=False)


def trajectory_sample(
    rollouts: Sequence[CompletedRollout], step: int, tokenizer: Any = None, limit: int = TRAJECTORY_SAMPLE_SIZE
) -> list[dict[str, Any]]:
    """The first ``limit`` rollouts with model calls, in dataset order, as table rows."""
    ordered = sorted((r for r in rollouts if r.triplets), key=lambda r: (r.step, r.sample_index))
    rows = []
    for rollout in ordered[:limit]:
        last = rollout.triplets[-1]
        rows.append(
            {
                "step": step,
                "rollout_id": rollout.rollout_id,
                "group_id": rollout.group_id,
                "reward": rollout.final_reward,
                "n_calls": len(rollout.triplets),
                "prompt": _decode(tokenizer, last.prompt_ids),
                "response": _decode(tokenizer, last.response_ids),
            }
        )
    return rows


def step_samples(
    rollouts: Sequence[CompletedRollout], mismatches: Sequence[Mismatch], step: int, tokenizer: Any = None
) -> dict[str, list[dict[str, Any]]]:
    """The step's tables; an empty one is left out."""
    tables = {
        "trajectories": trajectory_sample(rollouts, step, tokenizer),
        "mismatches": [{"step": step, **mismatch.to_dict()} for mismatch in mismatches],
    }
    return {name: rows for name, rows in tables.items() if rows}
