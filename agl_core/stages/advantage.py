"""What every advantage estimator shares: its settings, its result, and rollout/group indexing.

An estimator reads one reward per rollout (every row of a rollout must agree on group and reward),
compares rollouts within their group, and puts the result on the rollout's trained tokens.
:func:`rollout_level` builds a rollout-level estimator from a function of a group's rewards; the
built-ins live in :mod:`agl_core.builtins.estimators`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from agl_core.config import ConfigError
from agl_core.data import DataValidationError
from agl_core.errors import AglError
from agl_core.fields import is_number, reward_value

__all__ = [
    "AdvantageError",
    "AdvantageEstimator",
    "AdvantageSettings",
    "Advantages",
    "RolloutAdvantageError",
    "RolloutGroups",
    "broadcast",
    "group_rollouts",
    "require_group_size",
    "rollout_level",
]

METRIC_PREFIX = "training/rollout_level_advantage/"


class AdvantageError(AglError, ValueError):
    """The rows cannot be given advantages by this estimator (e.g. a group is too small)."""

    __module__ = "agl_core"


class RolloutAdvantageError(DataValidationError, RuntimeError):
    """A rollout cannot be given one advantage: its rows disagree on group or reward, or it has no
    trained token, or an estimator gave its tokens different values. Names the rollout and the
    field; also a ``RuntimeError``, which Agent Lightning v1.0 raised for the same rollout-level input."""

    __module__ = "agl_core"


@attrs.frozen
class AdvantageSettings:
    """What estimators read from the config: ``algorithm.norm_adv_by_std_in_grpo`` and
    ``algorithm.gamma`` (the per-turn discount of ``turn_grpo``; rollout-level estimators ignore it)."""

    norm_adv_by_std: bool = True
    gamma: float = 1.0
    epsilon: float = 1e-6

    @classmethod
    def from_config(cls, config: Any) -> AdvantageSettings:
        algorithm = config.algorithm
        norm = algorithm.get("norm_adv_by_std_in_grpo", True)
        if not isinstance(norm, bool):
            raise ConfigError("algorithm.norm_adv_by_std_in_grpo", f"must be a boolean, got {norm!r}")
        gamma = algorithm.get("gamma", 1.0)
        if not is_number(gamma) or not 0.0 <= gamma <= 1.0:
            raise ConfigError("algorithm.gamma", f"must be a number in [0, 1], got {gamma!r}")
        return cls(norm_adv_by_std=norm, gamma=float(gamma))


@attrs.frozen
class Advantages:
    """An estimator's result: ``per_row[i]`` is a read-only float32 array aligned with row ``i``'s
    response (zero wherever its ``response_mask`` is 0); ``metrics`` are for the step's log.

    ``returns`` are the value targets a critic would fit, aligned the same way; ``None`` when they are
    the advantages themselves, as for agl's built-in estimators (verl's ``grpo`` and ``rloo`` return
    the same tensor twice too).
    """

    per_row: tuple[np.ndarray, ...]
    metrics: Mapping[str, float] = attrs.field(factory=dict)
    returns: tuple[np.ndarray, ...] | None = None

    @property
    def returns_per_row(self) -> tuple[np.ndarray, ...]:
        return self.per_row if self.returns is None else self.returns


class AdvantageEstimator(Protocol):
    """What ``agl_register_advantage_estimators`` registers: credit for every row collected for the
    step (:class:`~agl_core.data.TrainingRow`), one array per row aligned with its response."""

    __module__ = "agl_core"

    def __call__(self, rows: Sequence[Any], settings: AdvantageSettings) -> Advantages: ...


@attrs.frozen
class RolloutGroups:
    """Rows indexed by rollout and group, after checking that each rollout's rows agree.

    ``rollouts`` maps rollout id to its row indices (in input order), ``groups`` maps group id to
    its rollout ids (in first-seen order), ``reward`` maps rollout id to its reward.
    """

    rollouts: dict[str, list[int]]
    groups: dict[str, list[str]]
    reward: dict[str, float]

    def metrics(self) -> dict[str, float]:
        sizes = [len(rows) for rows in self.rollouts.values()]
        return {
            f"{METRIC_PREFIX}n_rows": float(sum(sizes)),
            f"{METRIC_PREFIX}n_rollouts": float(len(sizes)),
            f"{METRIC_PREFIX}n_multi_row_rollouts": float(sum(1 for n in sizes if n > 1)),
            f"{METRIC_PREFIX}max_rows_per_rollout": float(max(sizes, default=0)),
        }


def group_rollouts(rows: Sequence[Any]) -> RolloutGroups:
    """Index ``rows`` by rollout and group; every row of a rollout must share its group and reward.

    Raises :class:`RolloutAdvantageError` naming the rollout and the field when rows of one rollout
    disagree, and :class:`~agl_core.data.DataValidationError` when a reward is not a finite number.
    """
    rollouts: dict[str, list[int]] = {}
    groups: dict[str, list[str]] = {}
    group_of: dict[str, str] = {}
    reward: dict[str, float] = {}
    for i, row in enumerate(rows):
        rid = row.rollout_id
        try:
            value = reward_value("reward", row.reward)
        except DataValidationError as err:
            raise err.within(f"rows[{i}]", rollout_id=rid) from None
        if rid not in rollouts:
            rollouts[rid] = [i]
            group_of[rid] = row.group_id
            reward[rid] = value
            groups.setdefault(row.group_id, []).append(rid)
            continue
        first = rollouts[rid][0]
        if row.group_id != group_of[rid]:
            raise RolloutAdvantageError(
                f"rows[{i}].group_id",
                f"rows of one rollout disagree on group: {group_of[rid]!r} (rows[{first}]) vs {row.group_id!r}",
                rid,
            )
        if value != reward[rid]:
            raise RolloutAdvantageError(
                f"rows[{i}].reward",
                f"rows of one rollout disagree on reward: {reward[rid]} (rows[{first}]) vs {value}",
                rid,
            )
        rollouts[rid].append(i)
    return RolloutGroups(rollouts=rollouts, groups=groups, reward=reward)


def require_group_size(indexed: RolloutGroups, estimator: str, minimum: int) -> None:
    """Raise :class:`AdvantageError` naming the first group with fewer than ``minimum`` rollouts
    (and its rollouts), so a run never trains on a baseline computed from too few samples."""
    for gid, rids in indexed.groups.items():
        if len(rids) < minimum:
            raise AdvantageError(
                f"group {gid!r} has {len(rids)} rollout(s) ({', '.join(rids)}); estimator {estimator!r} needs at "
                f"least {minimum} per group (raise actor_rollout_ref.rollout.n, or use 'reinforce')"
            )


def broadcast(row: Any, value: float | np.ndarray) -> np.ndarray:
    """``value`` (a scalar, or one value per response token) on the row's trained tokens, 0 elsewhere."""
    array = (np.asarray(row.response_mask, dtype=np.float64) * value).astype(np.float32)
    array.flags.writeable = False
    return array


def rollout_level(
    rows: Sequence[Any], estimator: str, minimum: int, group_advantages: Callable[[np.ndarray], np.ndarray]
) -> Advantages:
    """A rollout-level estimator's result from ``group_advantages`` (a group's rewards, one per
    rollout in first-seen order → one advantage per rollout), broadcast over every trained token of
    every row of each rollout. ``estimator`` names the estimator in errors; groups need at least
    ``minimum`` rollouts."""
    indexed = group_rollouts(rows)
    require_group_size(indexed, estimator, minimum)
    per_rollout: dict[str, float] = {}
    for rids in indexed.groups.values():
        rewards = np.array([indexed.reward[rid] for rid in rids], dtype=np.float64)
        values = group_advantages(rewards)
        per_rollout.update(zip(rids, values.tolist()))
    per_row = tuple(broadcast(row, per_rollout[row.rollout_id]) for row in rows)
    return Advantages(per_row=per_row, metrics=indexed.metrics())
