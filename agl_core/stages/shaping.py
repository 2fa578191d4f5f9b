"""Batch shaping: choose which whole rollouts a training step keeps, after advantages are known.

Rules, in order (:func:`shape_batch`):

1. Advantages are computed by the caller on **everything collected**, before this runs, so a drop
   never changes another rollout's advantage.
2. A rollout with any row marked ``dropped`` (its prompt exceeded its limit) is removed whole:
   all its rows count in ``training/n_sample_dropped/marked``.
3. The step keeps a whole number of PPO mini-batches of ``mini_batch_rows`` rows
   (``ppo_mini_batch_size × rollout.n``), at most ``max_updates`` of them
   (``agentlightning.max_ppo_update_times``): the target is the largest multiple of
   ``mini_batch_rows`` not above the rows left (and the cap) for which some set of whole rollouts
   has exactly that many rows.
4. Rollouts are removed whole, never some of their rows. The drop order is: rollouts of
   zero-variance groups (every collected reward of the group equal; their GRPO advantage is zero),
   group by group in a random order, then every other rollout in a random order, both drawn from a
   generator seeded with ``seed``. The kept set is the one that reaches the target while keeping
   rollouts as late in the drop order as possible (it is exact: when every rollout has one row it
   drops exactly the first rows of the order).
5. When rollouts have several rows, whole rollouts may not add up to the target: then the target
   moves down one mini-batch at a time until they do (possibly to zero rows; the step is then
   skipped by the caller). So a rollout whose rows do not fit goes whole, and one that stays, stays
   whole; a rollout of a group with variance may go while a zero-variance one stays only when no
   zero-variance rollout of the same row count could have gone in its place.

Metrics: ``training/n_sample_collected`` (every row given), ``training/n_sample_trained``,
``training/n_sample_dropped/{marked,same_reward,random}`` (rows removed by rules 2 and 4: from
zero-variance groups, or from the others), ``training/n_groups`` (groups in the kept rows) and
``training/n_zero_adv_groups`` (those of them whose collected advantages are zero on every trained
token). ``collected = trained + marked + same_reward + random`` always holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from agl_core.data import TrainingRow
from agl_core.errors import UsageError
from agl_core.stages.advantage import Advantages, RolloutGroups, group_rollouts
from agl_core.stages.normalization import rollout_scales

__all__ = ["ShapingSettings", "ShapedBatch", "shape_batch"]


@attrs.frozen
class ShapingSettings:
    """``mini_batch_rows`` = ``ppo_mini_batch_size × rollout.n``; ``max_updates`` =
    ``agentlightning.max_ppo_update_times`` (None: no cap); ``seed`` seeds the random drops."""

    mini_batch_rows: int
    max_updates: int | None = None
    seed: tuple[int, ...] = (0,)

    @classmethod
    def from_config(cls, config: Any, step: int) -> ShapingSettings:
        """From a validated run config; the drops of step ``step`` are seeded by ``(trainer.seed, step)``."""
        actor_rollout_ref = config.actor_rollout_ref
        return cls(
            mini_batch_rows=actor_rollout_ref.actor.ppo_mini_batch_size * actor_rollout_ref.rollout.n,
            max_updates=config.agentlightning.max_ppo_update_times,
            seed=(int(config.trainer.seed), int(step)),
        )


@attrs.frozen
class ShapedBatch:
    """What a step trains on: the kept rows (input order), their advantages and returns, the input
    indices they came from, how many mini-batches they make, and the shaping metrics."""

    rows: tuple[TrainingRow, ...]
    advantages: tuple[np.ndarray, ...]
    kept_indices: tuple[int, ...]
    n_mini_batches: int
    metrics: Mapping[str, float]
    returns: tuple[np.ndarray, ...]

    def row_scales(self, mode: str) -> np.ndarray:
        """The per-rollout normalisation of the kept rows (see :mod:`agl_core.stages.normalization`)."""
        return rollout_scales(
            [row.rollout_id for row in self.rows],
            [row.n_trained_tokens for row in self.rows],
            mode=mode,
            n_mini_batches=self.n_mini_batches,
        )


def _keep_exactly(sizes: list[int], target: int) -> list[bool] | None:
    """Which items (in keep-priority order) to keep so their sizes sum to ``target``, preferring
    earlier items; ``None`` if no subset sums to ``target``. Suffix subset-sum over int bitsets."""
    mask = (1 << (target + 1)) - 1
    reachable = [0] * (len(sizes) + 1)
    reachable[-1] = 1
    for i in range(len(sizes) - 1, -1, -1):
        reachable[i] = (reachable[i + 1] | (reachable[i + 1] << sizes[i])) & mask
    if not reachable[0] >> target & 1:
        return None
    keep = []
    remaining = target
    for i, size in enumerate(sizes):
        take = size <= remaining and bool(reachable[i + 1] >> (remaining - size) & 1)
        keep.append(take)
        remaining -= size if take else 0
    return keep


def _drop_order(indexed: RolloutGroups, marked: set[str], zero_variance: set[str], seed: Sequence[int]) -> list[str]:
    """Unmarked rollouts in the order they go: zero-variance groups first (whole groups, groups
    shuffled), then the other rollouts shuffled, both from ``seed``."""
    rng = np.random.default_rng(list(seed))
    zero_variance_order = [gid for gid in indexed.groups if gid in zero_variance]
    order = [
        rid
        for gid in rng.permutation(np.array(zero_variance_order, dtype=object)).tolist()
        for rid in indexed.groups[gid]
        if rid not in marked
    ]
    first = set(order)
    others = [rid for rid in indexed.rollouts if rid not in marked and rid not in first]
    return order + rng.permutation(np.array(others, dtype=object)).tolist()


def _shaping_metrics(
    rows: Sequence[TrainingRow],
    per_row: Sequence[np.ndarray],
    indexed: RolloutGroups,
    kept_indices: Sequence[int],
    dropped: dict[str, bool],
    marked: set[str],
    zero_variance: set[str],
) -> dict[str, float]:
    """The step's ``training/n_sample_*`` and group counts; ``dropped`` maps each candidate rollout to
    whether it went."""
    dropped_same = dropped_random = 0
    for rid, went in dropped.items():
        if went:
            n = len(indexed.rollouts[rid])
            if rows[indexed.rollouts[rid][0]].group_id in zero_variance:
                dropped_same += n
            else:
                dropped_random += n
    kept_groups = {rows[i].group_id for i in kept_indices}
    zero_adv_groups = {
        gid
        for gid in kept_groups
        if all(not np.any(per_row[i]) for rid in indexed.groups[gid] for i in indexed.rollouts[rid])
    }
    return {
        "training/n_sample_collected": float(len(rows)),
        "training/n_sample_trained": float(len(kept_indices)),
        "training/n_sample_dropped/marked": float(sum(len(indexed.rollouts[rid]) for rid in marked)),
        "training/n_sample_dropped/same_reward": float(dropped_same),
        "training/n_sample_dropped/random": float(dropped_random),
        "training/n_groups": float(len(kept_groups)),
        "training/n_zero_adv_groups": float(len(zero_adv_groups)),
    }


def shape_batch(
    rows: Sequence[TrainingRow], advantages: Advantages | Sequence[np.ndarray], settings: ShapingSettings
) -> ShapedBatch:
    """Keep whole rollouts making a whole number of mini-batches (the rules in the module docstring)."""
    per_row = advantages.per_row if isinstance(advantages, Advantages) else tuple(advantages)
    returns = advantages.returns_per_row if isinstance(advantages, Advantages) else per_row
    if len(per_row) != len(rows):
        raise UsageError(f"got advantages for {len(per_row)} rows, but {len(rows)} rows")
    for i, (row, adv) in enumerate(zip(rows, per_row)):
        if np.shape(adv) != row.response_mask.shape:
            raise UsageError(f"advantages[{i}] has shape {np.shape(adv)}, row {i} has {len(row.response_mask)} tokens")
    if settings.mini_batch_rows <= 0:
        raise UsageError(f"ShapingSettings.mini_batch_rows must be positive, got {settings.mini_batch_rows}")
    indexed = group_rollouts(rows)
    marked = {rid for rid, idx in indexed.rollouts.items() if any(rows[i].dropped for i in idx)}
    zero_variance = {gid for gid, rids in indexed.groups.items() if len({indexed.reward[r] for r in rids}) == 1}

    keep_order = _drop_order(indexed, marked, zero_variance, settings.seed)[::-1]
    sizes = [len(indexed.rollouts[rid]) for rid in keep_order]
    n_steps = sum(sizes) // settings.mini_batch_rows
    if settings.max_updates is not None:
        n_steps = min(n_steps, settings.max_updates)
    while (keep := _keep_exactly(sizes, n_steps * settings.mini_batch_rows)) is None:
        n_steps -= 1
    kept_rollouts = {rid for rid, take in zip(keep_order, keep) if take}
    kept_indices = tuple(i for i, row in enumerate(rows) if row.rollout_id in kept_rollouts)
    dropped = {rid: not take for rid, take in zip(keep_order, keep)}
    return ShapedBatch(
        rows=tuple(rows[i] for i in kept_indices),
        advantages=tuple(per_row[i] for i in kept_indices),
        kept_indices=kept_indices,
        n_mini_batches=n_steps,
        metrics=_shaping_metrics(rows, per_row, indexed, kept_indices, dropped, marked, zero_variance),
        returns=tuple(returns[i] for i in kept_indices),
    )
