"""agl: Agent Lightning's trainer side as a plugin system.

Everything a plugin author needs is importable from here (``__all__``): :data:`hookimpl`, the data
model, the protocols of what each ``agl_register_*`` hook registers (:class:`Aggregator`,
:class:`AdvantageEstimator`, :class:`PolicyLoss`, :class:`BackendSpec`, :class:`MetricSink`), the
toolkits an aggregator, estimator, loss, backend or sink is written with, the plugin manager and
the errors (all rooted in :class:`AglError`). Modules under ``agl_core`` are free to move; these
names are the stable surface. The public errors, protocols and plain classes name ``agl_core`` as
their module (``agl_core.ConfigError`` in a traceback), as pytest's do; attrs classes and
dataclasses keep the module defining them, where ``typing.get_type_hints`` resolves their fields'
annotations. Test helpers live in :mod:`agl_core.testing`.

A public name is imported from its module on first use (``__getattr__``, from ``_MODULES``), so
``import agl_core`` loads nothing but pluggy (the loss toolkit loads torch when a loss runs). The
imports under ``TYPE_CHECKING`` say the same to type checkers; a test keeps ``__all__``,
``_MODULES`` and those imports equal.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agl_core.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = [
    "CALLS_LEFT_OUT_METRIC",
    "MISMATCH_KINDS",
    "AdvantageError",
    "AdvantageEstimator",
    "AdvantageSettings",
    "Advantages",
    "AgentLightningConfig",
    "AglError",
    "Aggregation",
    "AggregationCounts",
    "AggregationSettings",
    "Aggregator",
    "Align",
    "Backend",
    "BackendFactory",
    "BackendSpec",
    "CompletedRollout",
    "ConfigCheck",
    "ConfigError",
    "ConfigFile",
    "ConfigLoader",
    "DataValidationError",
    "EventWriter",
    "FileFormatError",
    "FinishedGroup",
    "FrozenDict",
    "GatewayError",
    "Generation",
    "GroupStream",
    "HookTimeout",
    "LoopBackend",
    "LoopControl",
    "LoopSettings",
    "LossSettings",
    "MetricSink",
    "Mismatch",
    "NothingTrainedError",
    "OnStep",
    "PLAIN_UPDATE_KEYS",
    "PaddedBatch",
    "PerRolloutAggregator",
    "PluginError",
    "PluginManager",
    "PluginSettings",
    "PolicyLoss",
    "PolicyLossSpec",
    "PolicyServer",
    "PreparedBatch",
    "RecordingError",
    "Register",
    "RegistryError",
    "ReplayRolloutSource",
    "RequestError",
    "RolloutAdvantageError",
    "RolloutAggregation",
    "RolloutGroups",
    "RolloutRequest",
    "RolloutSource",
    "SamplingParams",
    "Served",
    "Segment",
    "SinkContext",
    "SinkFactory",
    "Step",
    "StepPipeline",
    "StepSamples",
    "TrainingRow",
    "Triplet",
    "UsageError",
    "UsageTypeError",
    "VisionSpec",
    "VllmEngineError",
    "__version__",
    "aggregate_trajectories",
    "check_plain_update",
    "check_text_policy",
    "broadcast",
    "check_rollout_source",
    "common_prefix_length",
    "default_config",
    "exact_prefix",
    "gateway_source",
    "group_rollouts",
    "group_stream",
    "hookimpl",
    "is_vision_policy",
    "load_config",
    "load_dataset",
    "load_policy_model",
    "masked_sum",
    "merge_config",
    "merged_row",
    "open_rollout_source",
    "policy_loss_spec",
    "ppo_token_losses",
    "read_recording",
    "require_group_size",
    "restore_source_state",
    "rollout_level",
    "rollout_reward",
    "rollout_timing_metrics",
    "run_ppo",
    "run_steps",
    "save_source_state",
    "tensorize",
    "trajectory_rollout",
    "validate_config",
    "validation_metrics",
    "write_dataset",
]

#: public name -> the module it is imported from on first use (``hookimpl`` is imported above).
_MODULES: dict[str, str] = {
    # the plugin system
    "EventWriter": "agl_core.plugins",
    "HookTimeout": "agl_core.plugins",
    "PluginError": "agl_core.plugins",
    "PluginManager": "agl_core.plugins",
    "PluginSettings": "agl_core.plugins",
    "Register": "agl_core.hookspecs",
    "RegistryError": "agl_core.plugins",
    # the data model and the datasets
    "CompletedRollout": "agl_core.data",
    "DataValidationError": "agl_core.data",
    "FrozenDict": "agl_core.data",
    "RolloutRequest": "agl_core.data",
    "StepSamples": "agl_core.data",
    "TrainingRow": "agl_core.data",
    "Triplet": "agl_core.data",
    "load_dataset": "agl_core.files.datasets",
    # the config
    "AgentLightningConfig": "agl_core.config",
    "ConfigError": "agl_core.config",
    "ConfigFile": "agl_core.config",
    "default_config": "agl_core.config",
    "load_config": "agl_core.config",
    "merge_config": "agl_core.config",
    "validate_config": "agl_core.config",
    # the errors agl raises on purpose (every one an AglError)
    "AglError": "agl_core.errors",
    "FileFormatError": "agl_core.errors",
    "UsageError": "agl_core.errors",
    "UsageTypeError": "agl_core.errors",
    "GatewayError": "agl_core.rollouts.gateway_error",
    "RecordingError": "agl_core.files.recording",
    "read_recording": "agl_core.files.recording",
    "run_ppo": "agl_core.runs.in_memory",
    "write_dataset": "agl_core.runs.in_memory",
    "VllmEngineError": "agl_core.serving.vllm_engine",
    # aggregators
    "CALLS_LEFT_OUT_METRIC": "agl_core.stages.aggregation",
    "MISMATCH_KINDS": "agl_core.stages.aggregation",
    "Aggregation": "agl_core.stages.aggregation",
    "AggregationCounts": "agl_core.stages.aggregation",
    "AggregationSettings": "agl_core.stages.aggregation",
    "Aggregator": "agl_core.stages.aggregation",
    "Mismatch": "agl_core.stages.aggregation",
    "PerRolloutAggregator": "agl_core.stages.aggregation",
    "RolloutAggregation": "agl_core.stages.aggregation",
    "Segment": "agl_core.stages.aggregation",
    "merged_row": "agl_core.stages.aggregation",
    "rollout_reward": "agl_core.stages.aggregation",
    "common_prefix_length": "agl_core.stages.mismatch",
    "Align": "agl_core.builtins.aggregators",
    "aggregate_trajectories": "agl_core.builtins.aggregators",
    "exact_prefix": "agl_core.builtins.aggregators",
    "trajectory_rollout": "agl_core.builtins.aggregators",
    # advantage estimators
    "AdvantageError": "agl_core.stages.advantage",
    "AdvantageEstimator": "agl_core.stages.advantage",
    "AdvantageSettings": "agl_core.stages.advantage",
    "Advantages": "agl_core.stages.advantage",
    "RolloutAdvantageError": "agl_core.stages.advantage",
    "RolloutGroups": "agl_core.stages.advantage",
    "broadcast": "agl_core.stages.advantage",
    "group_rollouts": "agl_core.stages.advantage",
    "require_group_size": "agl_core.stages.advantage",
    "rollout_level": "agl_core.stages.advantage",
    # policy losses
    "LossSettings": "agl_core.stages.policy_loss",
    "PolicyLoss": "agl_core.stages.policy_loss",
    "PolicyLossSpec": "agl_core.stages.policy_loss",
    "masked_sum": "agl_core.stages.policy_loss",
    "policy_loss_spec": "agl_core.stages.policy_loss",
    "ppo_token_losses": "agl_core.stages.policy_loss",
    # the step pipeline and the backend batch
    "StepPipeline": "agl_core.stages.pipeline",
    "PreparedBatch": "agl_core.stages.pipeline",
    "validation_metrics": "agl_core.stages.pipeline",
    "PaddedBatch": "agl_core.stages.tensorize",
    "tensorize": "agl_core.stages.tensorize",
    "VisionSpec": "agl_core.stages.vision",
    # rollout sources
    "RolloutSource": "agl_core.rollouts.source",
    "FinishedGroup": "agl_core.rollouts.source",
    "GroupStream": "agl_core.rollouts.streaming",
    "group_stream": "agl_core.rollouts.streaming",
    "rollout_timing_metrics": "agl_core.rollouts.events",
    "gateway_source": "agl_core.rollouts.gateway",
    "ReplayRolloutSource": "agl_core.rollouts.replay",
    # serving the policy to agents (what a backend's rollout replica answers with)
    "is_vision_policy": "agl_core.serving.models",
    "load_policy_model": "agl_core.serving.models",
    "PolicyServer": "agl_core.serving.policy_server",
    "RequestError": "agl_core.serving.policy_server",
    "Generation": "agl_core.serving.sampling",
    "SamplingParams": "agl_core.serving.sampling",
    # backends: the contract and the step loop
    "Backend": "agl_core.backends.contract",
    "BackendFactory": "agl_core.backends.contract",
    "BackendSpec": "agl_core.backends.contract",
    "ConfigCheck": "agl_core.backends.contract",
    "ConfigLoader": "agl_core.backends.contract",
    "OnStep": "agl_core.backends.contract",
    "PLAIN_UPDATE_KEYS": "agl_core.backends.contract",
    "check_plain_update": "agl_core.backends.contract",
    "check_text_policy": "agl_core.backends.contract",
    "LoopControl": "agl_core.backends.loop",
    "LoopSettings": "agl_core.backends.loop",
    "NothingTrainedError": "agl_core.backends.untrained",
    "Step": "agl_core.backends.loop",
    "run_steps": "agl_core.backends.loop",
    "LoopBackend": "agl_core.backends.loop_backend",
    "Served": "agl_core.backends.loop_backend",
    "open_rollout_source": "agl_core.backends.rollout_source",
    "check_rollout_source": "agl_core.backends.rollout_source",
    "save_source_state": "agl_core.backends.checkpoints",
    "restore_source_state": "agl_core.backends.checkpoints",
    # metric sinks
    "MetricSink": "agl_core.tracking",
    "SinkContext": "agl_core.tracking",
    "SinkFactory": "agl_core.tracking",
}

if TYPE_CHECKING:  # the names of _MODULES, for type checkers (sorted by module)
    from agl_core.backends.checkpoints import restore_source_state, save_source_state
    from agl_core.backends.contract import (
        PLAIN_UPDATE_KEYS,
        Backend,
        BackendFactory,
        BackendSpec,
        ConfigCheck,
        ConfigLoader,
        OnStep,
        check_plain_update,
        check_text_policy,
    )
    from agl_core.backends.loop import LoopControl, LoopSettings, Step, run_steps
    from agl_core.backends.loop_backend import LoopBackend, Served
    from agl_core.backends.rollout_source import check_rollout_source, open_rollout_source
    from agl_core.backends.untrained import NothingTrainedError
    from agl_core.builtins.aggregators import Align, aggregate_trajectories, exact_prefix, trajectory_rollout
    from agl_core.config import (
        AgentLightningConfig,
        ConfigError,
        ConfigFile,
        default_config,
        load_config,
        merge_config,
        validate_config,
    )
    from agl_core.data import (
        CompletedRollout,
        DataValidationError,
        FrozenDict,
        RolloutRequest,
        StepSamples,
        TrainingRow,
        Triplet,
    )
    from agl_core.errors import AglError, FileFormatError, UsageError, UsageTypeError
    from agl_core.files.datasets import load_dataset
    from agl_core.files.recording import RecordingError, read_recording
    from agl_core.hookspecs import Register
    from agl_core.plugins import EventWriter, HookTimeout, PluginError, PluginManager, PluginSettings, RegistryError
    from agl_core.rollouts.events import rollout_timing_metrics
    from agl_core.rollouts.gateway import gateway_source
    from agl_core.rollouts.gateway_error import GatewayError
    from agl_core.rollouts.replay import ReplayRolloutSource
    from agl_core.rollouts.source import FinishedGroup, RolloutSource
    from agl_core.rollouts.streaming import GroupStream, group_stream
    from agl_core.runs.in_memory import run_ppo, write_dataset
    from agl_core.serving.models import is_vision_policy, load_policy_model
    from agl_core.serving.policy_server import PolicyServer, RequestError
    from agl_core.serving.sampling import Generation, SamplingParams
    from agl_core.serving.vllm_engine import VllmEngineError
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
    from agl_core.stages.pipeline import PreparedBatch, StepPipeline, validation_metrics
    from agl_core.stages.policy_loss import (
        LossSettings,
        PolicyLoss,
        PolicyLossSpec,
        masked_sum,
        policy_loss_spec,
        ppo_token_losses,
    )
    from agl_core.stages.tensorize import PaddedBatch, tensorize
    from agl_core.stages.vision import VisionSpec
    from agl_core.tracking import MetricSink, SinkContext, SinkFactory


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'agl_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULES))
