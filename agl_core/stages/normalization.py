"""Per-rollout normalisation: the advantage scaling that turns ``per_rollout_mean`` into a mean over rollouts.

Applied once to the trained batch, after batch shaping and before the update (the step pipeline
multiplies each row's advantages by its scale, :class:`~agl_core.stages.pipeline.PreparedBatch`). Row ``i`` belongs to
rollout ``r(i)``; ``T_r`` is the number of trained tokens (``response_mask`` = 1) over all rows of
rollout ``r`` in the batch, ``N`` the number of rows, ``R`` the number of rollouts and ``M`` the number
of PPO mini-batches (optimizer steps per epoch) the batch is cut into. Each row's advantages are
multiplied by ``scale_i``:

* ``rollouts`` (default): ``scale_i = M / (T_r(i) * R)``, i.e. divide by ``T_r × R / M`` (the rollout's
  trained tokens × the mean number of rollouts per mini-batch). Every rollout's total weight
  (``sum`` of ``scale`` over its trained tokens) is ``M / R`` whatever its length or row count, so an
  optimizer step holding ``R / M`` rollouts has total weight 1: the step's loss is the mean over its
  rollouts of their token-mean losses, and its scale does not change when the same batch is cut into
  more or fewer mini-batches.
* ``upstream``: ``scale_i = 1 / (T_r(i) * N)``, Agent Lightning v1.0's scaling (divide by the rollout's
  trained tokens × the number of trained rows). Every rollout weighs ``1 / N``, so a step's total
  weight is about ``1 / M``: the update shrinks as the batch is cut into more mini-batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agl_core.config import LOSS_NORMALIZATION_MODES, ConfigError
from agl_core.errors import UsageError
from agl_core.fields import is_int

__all__ = ["LOSS_NORMALIZATION_MODES", "rollout_scales"]


def rollout_scales(
    rollout_ids: Sequence[str], row_trained_tokens: Sequence[int] | np.ndarray, *, mode: str, n_mini_batches: int
) -> np.ndarray:
    """``scale_i`` for every row (float64), by the formula of ``mode`` in the module docstring.

    Raises ``ValueError`` for an unknown mode, a non-positive ``n_mini_batches``, mismatched lengths,
    or a rollout without any trained token (it could not be given a weight).
    """
    if mode not in LOSS_NORMALIZATION_MODES:
        raise ConfigError(
            "agentlightning.loss_normalization",
            f"unknown loss normalization {mode!r}; expected one of {', '.join(LOSS_NORMALIZATION_MODES)}",
        )
    if not is_int(n_mini_batches, minimum=1):
        raise UsageError(f"n_mini_batches must be a positive integer, got {n_mini_batches!r}")
    tokens = np.asarray(row_trained_tokens, dtype=np.float64)
    if tokens.shape != (len(rollout_ids),):
        raise UsageError(f"got {len(rollout_ids)} rollout ids for {tokens.shape[0]} rows' token counts")
    per_rollout: dict[str, float] = {}
    for rid, n in zip(rollout_ids, tokens.tolist()):
        per_rollout[rid] = per_rollout.get(rid, 0.0) + n
    empty = [rid for rid, n in per_rollout.items() if n <= 0]
    if empty:
        raise UsageError(f"rollout {empty[0]!r} has no trained token in the batch; it cannot be normalised")
    rollout_tokens = np.array([per_rollout[rid] for rid in rollout_ids], dtype=np.float64)
    if mode == "upstream":
        return 1.0 / (rollout_tokens * len(rollout_ids))
    return n_mini_batches / (rollout_tokens * len(per_rollout))
