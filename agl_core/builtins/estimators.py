"""The built-in advantage estimators, registered as an ordinary plugin.

Every built-in but ``turn_grpo`` works at **rollout level**: the rows of one rollout are one
sample. The estimator reads one reward per rollout, compares rollouts within their group (the
dataset row's ``group_id``: the ``rollout.n`` rollouts of one prompt), and broadcasts the resulting
scalar over every trained token of every row of the rollout. A multi-row rollout (a trajectory
broken by a mismatch, or transition-level rows) therefore gets one advantage, not one per row.

For a group with rewards ``r_1..r_n`` (one per rollout) and ``eps = 1e-6`` (verl's epsilon):

* ``grpo``: ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the unbiased std (``n - 1``), or
  ``A_i = r_i - mean(r)`` when ``algorithm.norm_adv_by_std_in_grpo`` is false (Dr. GRPO);
* ``rloo``: ``A_i = r_i - mean_{j != i}(r_j) = n / (n - 1) * (r_i - mean(r))``;
* ``reinforce``: ``A_i = r_i`` (no baseline);
* ``reinforce_baseline``: ``A_i = r_i - mean(r)`` (group-mean baseline, never scaled).

A group whose rewards are all equal gets exactly zero advantage from the baselined estimators.
``grpo``, ``rloo`` and ``reinforce_baseline`` need at least two rollouts per group; ``reinforce``
needs one. ``turn_grpo`` (see :func:`turn_grpo`) assigns credit per model call instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from agl_core.data import DataValidationError
from agl_core.fields import reward_value
from agl_core.hookspecs import hookimpl
from agl_core.stages.advantage import (
    Advantages,
    AdvantageSettings,
    broadcast,
    group_rollouts,
    require_group_size,
    rollout_level,
)

__all__ = ["grpo", "reinforce", "reinforce_baseline", "rloo", "turn_grpo"]


def _centred(rewards: np.ndarray) -> np.ndarray:
    """``r - mean(r)``, exactly zero when every reward is equal (a float mean need not be exact)."""
    if np.ptp(rewards) == 0.0:
        return np.zeros_like(rewards)
    return rewards - rewards.mean()


def grpo(rows: Sequence[Any], settings: AdvantageSettings) -> Advantages:
    """Group-relative advantage: ``(r - mean) / (std + eps)``, or ``r - mean`` without std scaling."""

    def advantages(rewards: np.ndarray) -> np.ndarray:
        centred = _centred(rewards)
        if not settings.norm_adv_by_std:
            return centred
        return centred / (rewards.std(ddof=1) + settings.epsilon)

    return rollout_level(rows, "grpo", 2, advantages)


def rloo(rows: Sequence[Any], settings: AdvantageSettings) -> Advantages:
    """Leave-one-out baseline: each rollout is compared with the mean of the others in its group."""

    def advantages(rewards: np.ndarray) -> np.ndarray:
        n = len(rewards)
        return _centred(rewards) * (n / (n - 1))

    return rollout_level(rows, "rloo", 2, advantages)


def reinforce(rows: Sequence[Any], settings: AdvantageSettings) -> Advantages:
    """Plain REINFORCE: the rollout's reward is its advantage."""
    return rollout_level(rows, "reinforce", 1, lambda rewards: rewards)


def reinforce_baseline(rows: Sequence[Any], settings: AdvantageSettings) -> Advantages:
    """REINFORCE with the group's mean reward as baseline (never scaled by the std)."""
    return rollout_level(rows, "reinforce_baseline", 2, _centred)


def _call_rewards(rows: Sequence[Any], indices: list[int], rid: str, final_reward: float) -> np.ndarray:
    """One reward per model call of a rollout (see :func:`turn_grpo`)."""
    by_call: dict[int, float] = {}
    n_calls = 0
    for i in indices:
        row = rows[i]
        if row.response_turns is None:
            raise DataValidationError(
                f"rows[{i}].response_turns", "is required by the turn-aware estimator 'turn_grpo'", rid
            )
        if len(row.response_turns):
            n_calls = max(n_calls, int(row.response_turns.max()) + 1)
        n_calls = max(n_calls, row.turn_index + len(row.turn_rewards))
        for k, value in enumerate(row.turn_rewards):
            if value is None:
                continue
            call = row.turn_index + k
            value = reward_value(f"rows[{i}].turn_rewards[{k}]", value)
            if by_call.get(call, value) != value:
                raise DataValidationError(
                    f"rows[{i}].turn_rewards[{k}]",
                    f"call {call} has two different rewards in one rollout: {by_call[call]} and {value}",
                    rid,
                )
            by_call[call] = value
    rewards = np.zeros(max(n_calls, 1), dtype=np.float64)
    for call, value in by_call.items():
        rewards[call] = value
    if not by_call:
        rewards[-1] = final_reward
    return rewards


def _discounted_returns(rewards: np.ndarray, gamma: float) -> np.ndarray:
    returns = np.empty_like(rewards)
    running = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + gamma * running
        returns[k] = running
    return returns


def turn_grpo(rows: Sequence[Any], settings: AdvantageSettings) -> Advantages:
    """Turn-aware GRPO: each model call gets its own advantage from its discounted reward-to-go.

    For a rollout with calls ``k = 0..K-1`` (``K`` covers every call index in its rows'
    ``response_turns`` and ``turn_index + len(turn_rewards)``):

    1. per-call rewards ``c_k`` are the ``turn_rewards`` of its rows (``None`` counts as 0; two
       rows giving one call different rewards is an error). When no call of the rollout carries a
       reward, the rollout's final reward is placed on its last call: ``c_{K-1} = reward``;
    2. the reward-to-go of call ``k`` is ``G_k = sum_{j >= k} gamma^(j - k) * c_j``
       (``gamma = algorithm.gamma``);
    3. within a group of ``n`` rollouts, each rollout weighing the same whatever its call count,
       ``mu = mean_r(mean_k G_rk)`` and ``sigma^2 = sum_r mean_k (G_rk - mu)^2 / (n - 1)``;
    4. ``A_rk = (G_rk - mu) / (sigma + eps)``, or ``G_rk - mu`` when
       ``algorithm.norm_adv_by_std_in_grpo`` is false; zero when every ``G`` of the group is equal;
    5. each trained token gets the advantage of its call (``response_turns``); untrained tokens 0.

    With ``gamma = 1`` and only final rewards, every ``G_rk`` is the rollout's reward and this is
    exactly rollout-level ``grpo``. Per-call rewards or ``gamma < 1`` make the calls of one rollout
    differ: earlier calls are credited with everything that followed them, later calls only with
    what followed them. Needs ``response_turns`` on every row and two rollouts per group.
    """
    indexed = group_rollouts(rows)
    require_group_size(indexed, "turn_grpo", 2)
    per_call: dict[str, np.ndarray] = {}
    for rids in indexed.groups.values():
        returns = {
            rid: _discounted_returns(
                _call_rewards(rows, indexed.rollouts[rid], rid, indexed.reward[rid]), settings.gamma
            )
            for rid in rids
        }
        pooled = np.concatenate(list(returns.values()))
        if np.ptp(pooled) == 0.0:
            per_call.update({rid: np.zeros_like(g) for rid, g in returns.items()})
            continue
        mu = float(np.mean([g.mean() for g in returns.values()]))
        sigma = math.sqrt(sum(float(((g - mu) ** 2).mean()) for g in returns.values()) / (len(rids) - 1))
        scale = sigma + settings.epsilon if settings.norm_adv_by_std else 1.0
        per_call.update({rid: (g - mu) / scale for rid, g in returns.items()})
    per_row = tuple(broadcast(row, per_call[row.rollout_id][row.response_turns]) for row in rows)
    return Advantages(per_row=per_row, metrics=indexed.metrics())


@hookimpl
def agl_register_advantage_estimators(register: Any) -> None:
    register("grpo", grpo)
    register("rloo", rloo)
    register("reinforce", reinforce)
    register("reinforce_baseline", reinforce_baseline)
    register("turn_grpo", turn_grpo)
