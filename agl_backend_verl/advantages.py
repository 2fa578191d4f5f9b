"""Advantages on the verl backend: verl's own estimators by their verl names, agl's plugins otherwise.

``algorithm.adv_estimator`` naming an estimator verl defines (``grpo``, ``rloo``,
``reinforce_plus_plus``...) runs verl's ``compute_advantage`` — the same code and numbers as verl's
own trainer — on **one representative row per rollout** (groups = the rollouts' group ids), and the
rollout's scalar is broadcast over every trained token of every row of that rollout, as Agent
Lightning v1.0 does. Any other name is looked up in agl's advantage-estimator registry.

With ``algorithm.enable_rollout_level_advantage: false`` every row is its own sample instead (as in
verl's own trainer). Either way advantages are computed on every collected row, before batch
shaping drops any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from agl_core.stages.advantage import Advantages, AdvantageSettings, group_rollouts
from agl_core.data import TrainingRow
from agl_core.stages.tensorize import tensorize
from agl_backend_verl.config import ROLLOUT_LEVEL_KEY, verl_algorithm_config
from agl_backend_verl.dataproto import to_dataproto

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_core.plugins import PluginManager


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
    """verl's estimator ``algorithm.adv_estimator`` on one representative row per rollout, broadcast.

    The representative is the rollout's first row with a trained token; rows of a rollout must share
    group and reward (checked). The estimator must give one value over the representative's trained
    tokens (an outcome estimator); anything else is an error naming the rollout.
    """
    from verl.trainer.ppo.ray_trainer import compute_advantage

    indexed = group_rollouts(rows)
    representatives = []
    for rid, indices in indexed.rollouts.items():
        trained = [i for i in indices if rows[i].response_mask.any()]
        if not trained:
            raise ValueError(f"rollout {rid!r} has no trained token; it cannot be given an advantage")
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
    per_rollout: dict[str, float] = {}
    mask = data.batch["response_mask"].bool()
    for k, rep in enumerate(representatives):
        values = data.batch["advantages"][k][mask[k]]
        if not torch.allclose(values, values[0].expand_as(values)):
            raise ValueError(
                f"estimator {algorithm.adv_estimator!r} gave rollout {rep.rollout_id!r} different advantages on "
                "different tokens; only outcome estimators can be computed once per rollout"
            )
        per_rollout[rep.rollout_id] = float(values[0])
    per_row = []
    for row in rows:
        array = (row.response_mask.astype(np.float32) * np.float32(per_rollout[row.rollout_id])).astype(np.float32)
        array.flags.writeable = False
        per_row.append(array)
    return Advantages(per_row=tuple(per_row), metrics=indexed.metrics())


def compute_advantages(rows: Sequence[TrainingRow], config: DictConfig, plugins: PluginManager, pad_token_id: int = 0) -> Advantages:
    """Advantages of every row by ``algorithm.adv_estimator`` (see the module docstring)."""
    name = str(config.algorithm.adv_estimator)
    samples = list(rows) if config.algorithm[ROLLOUT_LEVEL_KEY] else as_samples(rows)
    if is_verl_estimator(name):
        return verl_rollout_advantages(samples, config, pad_token_id)
    estimate = plugins.advantage_estimators.get(name)
    return estimate(samples, AdvantageSettings.from_config(config))
