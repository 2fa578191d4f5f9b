"""agl: Agent Lightning's trainer side as a plugin system.

Everything a plugin author needs is importable from here (``__all__``): :data:`hookimpl`, the data
model, the protocols of what each ``agl_register_*`` hook registers (:class:`Aggregator`,
:class:`AdvantageEstimator`, :class:`PolicyLoss`, :class:`BackendSpec`, :class:`MetricSink`), the
toolkits an aggregator, estimator, loss, backend or sink is written with, the plugin manager and
the errors (all rooted in :class:`AglError`). Modules under ``agl_core`` are free to move; these
names are the stable surface. Test helpers live in :mod:`agl_core.testing`.

The imports under ``TYPE_CHECKING`` below are the one list of public names: type checkers read
them, and at run time each name is imported from its module on first use (``__getattr__``), so
``import agl_core`` loads nothing but pluggy (the loss names need torch).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl_core._moved import install as _serve_moved_modules
from agl_core.hookspecs import hookimpl

_serve_moved_modules()  # old module paths stay importable, with a warning, for one minor release

if TYPE_CHECKING:
    # the plugin system and the data model
    # backends: the contract, the step loop, the step pipeline and the rollout sources it drives
    from agl_core.backends.contract import Backend, BackendFactory, BackendSpec, ConfigCheck, ConfigLoader, OnStep
    from agl_core.backends.loop import LoopSettings, Step, run_steps
    from agl_core.builtins.aggregators import Align, aggregate_trajectories, exact_prefix, trajectory_rollout
    from agl_core.config import AgentLightningConfig, ConfigError, ConfigFile, default_config, load_config, merge_config
    from agl_core.config.checks import validate as validate_config
    from agl_core.data import (
        CompletedRollout,
        DataValidationError,
        FrozenDict,
        RolloutRequest,
        StepSamples,
        TrainingRow,
        Triplet,
    )
    from agl_core.datasets import load_dataset
    from agl_core.errors import AglError
    from agl_core.hookspecs import Register
    from agl_core.plugins import EventWriter, PluginError, PluginManager, PluginSettings, RegistryError
    from agl_core.rollouts.gateway import gateway_source
    from agl_core.rollouts.replay import ReplayRolloutSource
    from agl_core.rollouts.source import RolloutSource

    # serving the policy to agents (what a backend's rollout replica answers with)
    from agl_core.serving.policy_server import PolicyServer, RequestError
    from agl_core.serving.sampling import Generation, SamplingParams

    # advantage estimators
    from agl_core.stages.advantage import (
        AdvantageError,
        AdvantageEstimator,
        Advantages,
        AdvantageSettings,
        RolloutAdvantageError,
        RolloutGroups,
        broadcast,
        group_rollouts,
        require_group_size,
        rollout_level,
    )

    # aggregators
    from agl_core.stages.aggregation import (
        CALLS_LEFT_OUT_METRIC,
        MISMATCH_KINDS,
        Aggregation,
        AggregationCounts,
        AggregationSettings,
        Aggregator,
        Mismatch,
        PerRolloutAggregator,
        RolloutAggregation,
        Segment,
        merged_row,
        rollout_reward,
    )
    from agl_core.stages.mismatch import common_prefix_length
    from agl_core.stages.pipeline import StepPipeline, validation_metrics

    # policy losses
    from agl_core.stages.policy_loss import (
        LossSettings,
        PolicyLoss,
        PolicyLossSpec,
        masked_sum,
        policy_loss_spec,
        ppo_token_losses,
    )
    from agl_core.stages.prefix_sharing import PromptGroups, prompt_groups
    from agl_core.stages.tensorize import PaddedBatch, tensorize

    # metric sinks
    from agl_core.tracking import MetricSink, SinkContext, SinkFactory

__version__ = "0.1.0"


def _type_checking_imports() -> dict[str, tuple[str, str]]:
    """Public name -> (module, name there), read from the ``if TYPE_CHECKING:`` block of this file."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(
        node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
    )
    return {
        alias.asname or alias.name: (statement.module, alias.name)
        for statement in block.body
        if isinstance(statement, ast.ImportFrom)
        for alias in statement.names
    }


_LAZY = _type_checking_imports()

__all__ = sorted(["__version__", "hookimpl", *_LAZY])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'agl_core' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
