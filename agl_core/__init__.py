"""agl: Agent Lightning's trainer side as a plugin system.

Everything a plugin author needs is importable from here (``__all__``): :data:`hookimpl`, the data
model, the aggregation, advantage and loss toolkits with their settings and results, the plugin
manager and the errors. Modules under ``agl_core`` are free to move; these names are the stable
surface. The loss names (:class:`~agl_core.stages.policy_loss.LossSettings`,
:class:`~agl_core.stages.policy_loss.PolicyLossSpec`...) need torch and are imported on first use,
so ``import agl_core`` stays light. Test helpers live in :mod:`agl_core.testing`.
"""

from __future__ import annotations

import importlib
from typing import Any

from agl_core.hookspecs import hookimpl
from agl_core.config import ConfigError
from agl_core.data import CompletedRollout, DataValidationError, FrozenDict, RolloutRequest, TrainingRow, Triplet
from agl_core.plugins import EventWriter, PluginError, PluginManager, RegistryError
from agl_core.stages.advantage import (
    AdvantageError,
    Advantages,
    AdvantageSettings,
    RolloutGroups,
    broadcast,
    group_rollouts,
    require_group_size,
    rollout_level,
)
from agl_core.stages.aggregation import (
    CALLS_LEFT_OUT_METRIC,
    MISMATCH_KINDS,
    Aggregation,
    AggregationCounts,
    AggregationSettings,
    Mismatch,
    Segment,
    merged_row,
    rollout_reward,
)
from agl_core.stages.levels import Align, aggregate_trajectories, exact_prefix
from agl_core.stages.mismatch import common_prefix_length

__version__ = "0.1.0"

# name -> module, imported on first access (they need torch).
_LAZY = {
    "LossSettings": "agl_core.stages.policy_loss",
    "PolicyLoss": "agl_core.stages.policy_loss",
    "PolicyLossSpec": "agl_core.stages.policy_loss",
    "masked_sum": "agl_core.stages.policy_loss",
    "policy_loss_spec": "agl_core.stages.policy_loss",
    "ppo_token_losses": "agl_core.stages.policy_loss",
}

__all__ = [
    "CALLS_LEFT_OUT_METRIC",
    "MISMATCH_KINDS",
    "AdvantageError",
    "AdvantageSettings",
    "Advantages",
    "Aggregation",
    "AggregationCounts",
    "AggregationSettings",
    "Align",
    "CompletedRollout",
    "ConfigError",
    "DataValidationError",
    "EventWriter",
    "FrozenDict",
    "LossSettings",
    "Mismatch",
    "PluginError",
    "PluginManager",
    "PolicyLoss",
    "PolicyLossSpec",
    "RegistryError",
    "RolloutGroups",
    "RolloutRequest",
    "Segment",
    "TrainingRow",
    "Triplet",
    "__version__",
    "aggregate_trajectories",
    "broadcast",
    "common_prefix_length",
    "exact_prefix",
    "group_rollouts",
    "hookimpl",
    "masked_sum",
    "merged_row",
    "policy_loss_spec",
    "ppo_token_losses",
    "require_group_size",
    "rollout_level",
    "rollout_reward",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'agl_core' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
