"""Run your plugin on real recorded steps: what an aggregator, estimator or loss setting makes of
rollouts that real agents produced, without agents, a gateway or a model.

::

    from agl_core.testing.recorded import recorded_steps, run_pipeline

    for step, rollouts in recorded_steps("tests/fixtures/corridor_recording").items():
        prepared = run_pipeline(rollouts, plugins=[my_plugin], overrides={"algorithm.adv_estimator": "mine"},
                                config="tests/fixtures/corridor_recording")
        assert prepared.metrics["training/n_sample"] > 0

:func:`recorded_steps` reads a recording that ``agentlightning.record_rollouts`` wrote
(:mod:`agl_core.files.recording`); :func:`gateway_trace_rollouts` parses traces stored from the real
Agent Lightning gateway (``{"scenarios": {NAME: {"rollout": ..., "events": ...}}}``, the layout of the
repository's ``tests/fixtures/gateway_traces/traces.json``) with agl's own events parser.
:func:`run_pipeline` runs the step pipeline every backend runs
(``agl_core.stages.pipeline.StepPipeline``: vocabulary check with a tokenizer, aggregation,
advantages, batch shaping, per-rollout normalisation) and returns its
``agl_core.stages.pipeline.PreparedBatch``: the kept rows, their advantages and the metrics.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from omegaconf import OmegaConf

from agl_core.config import default_config, load_config
from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.files.recording import read_recording
from agl_core.plugins import PluginManager
from agl_core.rollouts.events import completed_rollout_from_record
from agl_core.stages.pipeline import PreparedBatch, StepPipeline

__all__ = ["gateway_trace_rollouts", "recorded_steps", "run_pipeline"]


def recorded_steps(path: str | os.PathLike[str]) -> dict[int, tuple[CompletedRollout, ...]]:
    """Each recorded step's rollouts, by step number (``path``: a recording, or a run directory)."""
    return dict(read_recording(path).steps)


def gateway_trace_rollouts(
    path: str | os.PathLike[str],
    scenarios: Sequence[str] | None = None,
    group_id: str = "gateway-traces",
    reward_fillna_value: float = 0.0,
) -> list[CompletedRollout]:
    """The stored gateway traces at ``path`` as completed rollouts, one per scenario (``scenarios``:
    those names, in that order; default all), all in the group ``group_id``: each scenario's raw
    events and rollout record parsed as the gateway source parses them."""
    with open(path, encoding="utf-8") as f:
        stored = json.load(f)["scenarios"]
    out = []
    for name in scenarios if scenarios is not None else list(stored):
        if name not in stored:
            raise KeyError(f"{os.fspath(path)} has no scenario {name!r}; it has {', '.join(stored)}")
        record = stored[name]["rollout"]
        record = record.get("rollout", record)  # GET /api/rollouts/{id} answers {rollout, attempts}
        request = RolloutRequest(
            rollout_id=name, group_id=group_id, input=record.get("input"), is_train=bool(record.get("is_train", True))
        )
        rollout, _ = completed_rollout_from_record(
            request, record, stored[name]["events"], reward_fillna_value=reward_fillna_value
        )
        out.append(rollout)
    return out


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def run_pipeline(
    rollouts: Iterable[CompletedRollout],
    plugins: Iterable[Any] = (),
    overrides: Mapping[str, Any] | Sequence[str] = (),
    config: str | os.PathLike[str] | None = None,
    step: int = 1,
    tokenizer: Any = None,
) -> PreparedBatch:
    """One step of the shared pipeline on ``rollouts`` with ``plugins`` registered (built-ins too,
    installed plugins not).

    The config is the recorded run's (``config``: its recording or run directory; its core-schema
    keys) or the defaults, then ``overrides`` (a mapping or ``key=value`` strings). ``tokenizer``
    (optional) turns on the vocabulary check and decoded sample tables, as in training."""
    base = default_config()
    if config is not None:
        base = OmegaConf.merge(base, read_recording(config).core_config())
    given = overrides.items() if isinstance(overrides, Mapping) else (o.split("=", 1) for o in overrides)
    # running a recorded step never records it again
    cfg = load_config(None, [*(f"{k}={_yaml(v)}" for k, v in given), "agentlightning.record_rollouts=false"], base=base)
    manager = PluginManager(load_entrypoints=False)
    for plugin in plugins:
        manager.register(plugin)
    return StepPipeline(cfg, manager, tokenizer).prepare(list(rollouts), step)
