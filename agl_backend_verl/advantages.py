"""Advantages on the verl backend: verl's own estimators by their verl names, agl's plugins otherwise.

``algorithm.adv_estimator`` naming an estimator verl defines (``grpo``, ``rloo``,
``reinforce_plus_plus``...) runs verl's ``compute_advantage`` — the same code and numbers as verl's
own trainer — on **one representative row per rollout** (groups = the rollouts' group ids), and the
rollout's advantage and return are broadcast over every trained token of every row of that rollout,
as Agent Lightning v1.0 does. Any other name is looked up in agl's advantage-estimator registry.

With ``algorithm.enable_rollout_level_advantage: false`` every row is its own sample instead (as in
verl's own trainer). Either way advantages are computed on every collected row, before batch
shaping drops any, except ``gae``'s (:func:`needs_values`): it needs the critic's ``values`` of
the trained rows, so the pipeline gets zeros in their place and the trainer runs verl's
``_compute_advantage`` once the critic has scored the batch, as verl's own trainer orders it
(values → advantages → critic update → actor update). Under ``gae`` the shaping metric
``training/n_zero_adv_groups`` therefore counts every kept group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from agl_backend_verl.config import ROLLOUT_LEVEL_KEY, verl_algorithm_config
from agl_backend_verl.dataproto import to_dataproto
from agl_core import (
    Advantages,
    AdvantageSettings,
    RolloutAdvantageError,
    TrainingRow,
    broadcast,
    group_rollouts,
    tensorize,
)

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from verl import DataProto

    from agl_core import PluginManager


def is_verl_estimator(name: str) -> bool:
    """Whether verl itself defines ``name`` (agl's plugins registered in verl do not count)."""
    from verl.trainer.ppo import core_algos

    if name in {e.value for e in core_algos.AdvantageEstimator}:
        return True
    fn = core_algos.ADV_ESTIMATOR_REGISTRY.get(name)
    return fn is not None and not getattr(fn, "_agl_plugin", None)


def as_samples(rows: Sequence[TrainingRow]) -> list[TrainingRow]:
    """Each row as a rollout of its own (its id suffixed with its index), for per-row estimation."""
    return [attrs.evolve(row, rollout_id=f"{row.rollout_id}#{i}") for i, row in enumerate(rows)]


def verl_rollout_advantages(rows: Sequence[TrainingRow], config: DictConfig, pad_token_id: int = 0) -> Advantages:
    """verl's estimator ``algorithm.adv_estimator`` on one representative row per rollout, broadcast:
    its advantages and its returns, as Agent Lightning v1.0 does.

    The representative is the rollout's first row with a trained token; rows of a rollout must share
    group and reward (checked). The estimator must give one value over the representative's trained
    tokens (an outcome estimator); anything else is a :class:`RolloutAdvantageError` naming the rollout.
    """
    from verl.trainer.ppo.ray_trainer import compute_advantage

    indexed = group_rollouts(rows)
    representatives = []
    for rid, indices in indexed.rollouts.items():
        trained = [i for i in indices if rows[i].response_mask.any()]
        if not trained:
            raise RolloutAdvantageError(
                "response_mask", "the rollout has no trained token; it cannot be given an advantage", rid
            )
        representatives.append(attrs.evolve(rows[trained[0]], dropped=False))
    data = to_dataproto(tensorize(representatives, pad_token_id=pad_token_id))
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    algorithm = config.algorithm
    data = compute_advantage(
        data,
        adv_estimator=algorithm.adv_estimator,
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        num_repeat=config.actor_rollout_ref.rollout.n,
        norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True),
        config=verl_algorithm_config(config),
    )
    advantages = _per_rollout(data, "advantages", representatives, algorithm.adv_estimator)
    returns = _per_rollout(data, "returns", representatives, algorithm.adv_estimator)
    return Advantages(
        per_row=tuple(broadcast(row, advantages[row.rollout_id]) for row in rows),
        metrics=indexed.metrics(),
        returns=tuple(broadcast(row, returns[row.rollout_id]) for row in rows),
    )


def _per_rollout(data: DataProto, key: str, representatives: Sequence[TrainingRow], estimator: str) -> dict[str, float]:
    """The one value ``data.batch[key]`` holds over each representative's trained tokens."""
    mask = data.batch["response_mask"].bool()
    per_rollout = {}
    for k, rep in enumerate(representatives):
        values = data.batch[key][k][mask[k]]
        if not torch.allclose(values, values[0].expand_as(values)):
            raise RolloutAdvantageError(
                key,
                f"estimator {estimator!r} gave different {key} on different tokens; only outcome estimators can "
                "be computed once per rollout",
                rep.rollout_id,
            )
        per_rollout[rep.rollout_id] = float(values[0])
    return per_rollout


def needs_values(config: DictConfig) -> bool:
    """Whether ``algorithm.adv_estimator`` needs the critic's ``values`` (verl's ``gae``)."""
    return str(config.algorithm.adv_estimator) == "gae"


def compute_advantages(
    rows: Sequence[TrainingRow], config: DictConfig, plugins: PluginManager, pad_token_id: int = 0
) -> Advantages:
    """Advantages of every row by ``algorithm.adv_estimator`` (see the module docstring)."""
    name = str(config.algorithm.adv_estimator)
    if needs_values(config):  # computed after the critic's values (the trainer's _compute_advantage)
        zeros = tuple(np.zeros(row.response_mask.shape, dtype=np.float32) for row in rows)
        return Advantages(per_row=zeros)
    samples = list(rows) if config.algorithm[ROLLOUT_LEVEL_KEY] else as_samples(rows)
    if is_verl_estimator(name):
        return verl_rollout_advantages(samples, config, pad_token_id)
    estimate = plugins.advantage_estimators.get(name)
    return estimate(samples, AdvantageSettings.from_config(config))
