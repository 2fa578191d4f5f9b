"""agl: Agent Lightning's trainer side as a plugin system.

Everything a plugin author needs is importable from here (``__all__``): :data:`hookimpl`, the data
model, the aggregation, advantage and loss toolkits with their settings and results, the plugin
manager and the errors. Modules under ``agl_core`` are free to move; these names are the stable
surface. Every name but :data:`hookimpl` is imported on first use, so ``import agl_core`` loads nothing but
pluggy (the loss names need torch). Test helpers live in :mod:`agl_core.testing`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agl_core.hookspecs import hookimpl
from agl_core._moved import install as _serve_moved_modules

_serve_moved_modules()  # old module paths stay importable, with a warning, for one minor release

if TYPE_CHECKING:
    from agl_core.backends.contract import Backend, BackendSpec, OnStep
    from agl_core.config import ConfigError
    from agl_core.data import CompletedRollout, DataValidationError, FrozenDict, RolloutRequest, TrainingRow, Triplet
    from agl_core.plugins import EventWriter, PluginError, PluginManager, PluginSettings, RegistryError
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
    from agl_core.stages.policy_loss import LossSettings, PolicyLoss, PolicyLossSpec, masked_sum, policy_loss_spec, ppo_token_losses
    from agl_core.tracking import MetricSink, SinkContext, SinkFactory

__version__ = "0.1.0"

# Every public name but hookimpl -> its module, imported on first access, so that ``import agl_core``
# (which pytest's plugin loading does in every project where agl is installed) stays light.
_LAZY = {
    "AdvantageError": "agl_core.stages.advantage",
    "AdvantageSettings": "agl_core.stages.advantage",
    "Advantages": "agl_core.stages.advantage",
    "Aggregation": "agl_core.stages.aggregation",
    "AggregationCounts": "agl_core.stages.aggregation",
    "AggregationSettings": "agl_core.stages.aggregation",
    "Align": "agl_core.stages.levels",
    "Backend": "agl_core.backends.contract",
    "BackendSpec": "agl_core.backends.contract",
    "CALLS_LEFT_OUT_METRIC": "agl_core.stages.aggregation",
    "CompletedRollout": "agl_core.data",
    "ConfigError": "agl_core.config",
    "DataValidationError": "agl_core.data",
    "EventWriter": "agl_core.plugins",
    "FrozenDict": "agl_core.data",
    "LossSettings": "agl_core.stages.policy_loss",
    "MISMATCH_KINDS": "agl_core.stages.aggregation",
    "MetricSink": "agl_core.tracking",
    "Mismatch": "agl_core.stages.aggregation",
    "OnStep": "agl_core.backends.contract",
    "PluginError": "agl_core.plugins",
    "PluginManager": "agl_core.plugins",
    "PluginSettings": "agl_core.plugins",
    "PolicyLoss": "agl_core.stages.policy_loss",
    "PolicyLossSpec": "agl_core.stages.policy_loss",
    "RegistryError": "agl_core.plugins",
    "RolloutGroups": "agl_core.stages.advantage",
    "RolloutRequest": "agl_core.data",
    "Segment": "agl_core.stages.aggregation",
    "SinkContext": "agl_core.tracking",
    "SinkFactory": "agl_core.tracking",
    "TrainingRow": "agl_core.data",
    "Triplet": "agl_core.data",
    "aggregate_trajectories": "agl_core.stages.levels",
    "broadcast": "agl_core.stages.advantage",
    "common_prefix_length": "agl_core.stages.mismatch",
    "exact_prefix": "agl_core.stages.levels",
    "group_rollouts": "agl_core.stages.advantage",
    "masked_sum": "agl_core.stages.policy_loss",
    "merged_row": "agl_core.stages.aggregation",
    "policy_loss_spec": "agl_core.stages.policy_loss",
    "ppo_token_losses": "agl_core.stages.policy_loss",
    "require_group_size": "agl_core.stages.advantage",
    "rollout_level": "agl_core.stages.advantage",
    "rollout_reward": "agl_core.stages.aggregation",
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
    "Backend",
    "BackendSpec",
    "CompletedRollout",
    "ConfigError",
    "DataValidationError",
    "EventWriter",
    "FrozenDict",
    "LossSettings",
    "MetricSink",
    "Mismatch",
    "OnStep",
    "PluginError",
    "PluginManager",
    "PluginSettings",
    "PolicyLoss",
    "PolicyLossSpec",
    "RegistryError",
    "RolloutGroups",
    "RolloutRequest",
    "Segment",
    "SinkContext",
    "SinkFactory",
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
