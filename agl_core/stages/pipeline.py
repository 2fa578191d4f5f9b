"""The backend-agnostic middle of a training step: completed rollouts → what the update trains on.

Every backend runs :class:`StepPipeline` between its rollouts and its update, so aggregation,
advantage estimation on everything collected (before any row is dropped, so drops never change
another rollout's advantage), batch shaping and the per-rollout
normalisation are one piece of code on every backend; only the update itself is the backend's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from agl_core.data import CompletedRollout, TrainingRow
from agl_core.errors import UsageError
from agl_core.files.recording import RecordingWriter
from agl_core.stages.advantage import Advantages, AdvantageSettings
from agl_core.stages.aggregation import (
    Aggregation,
    PerRolloutAggregator,
    RolloutAggregation,
    settings_from_config,
    write_mismatches_jsonl,
)
from agl_core.stages.policy_loss import policy_loss_spec
from agl_core.stages.samples import step_samples
from agl_core.stages.shaping import ShapedBatch, ShapingSettings, shape_batch
from agl_core.stages.tensorize import pad_responses
from agl_core.stages.vocabulary import OUT_OF_VOCAB_METRIC, within_vocabulary

__all__ = ["PreparedBatch", "StepPipeline", "rollout_metrics", "staleness_metrics"]


def rollout_metrics(rollouts: Sequence[CompletedRollout], prefix: str) -> dict[str, float]:
    """``{prefix}/n_rollouts`` and ``{prefix}/reward`` (the mean final reward) of a set of rollouts."""
    rewards = [r.final_reward for r in rollouts if r.final_reward is not None]
    return {
        f"{prefix}/n_rollouts": float(len(rollouts)),
        f"{prefix}/reward": float(np.mean(rewards)) if rewards else float("nan"),
    }


def validation_metrics(
    rollouts: Sequence[CompletedRollout], source_metrics: Sequence[Mapping[str, float]]
) -> dict[str, float]:
    """A validation pass's ``val/*`` metrics, the same on every backend: over ``rollouts`` (every batch's)
    and the rollout sources' metrics of each batch (``source_metrics``).

    Agent Lightning v1.0's set, over the rollouts with at least one model call ("with a trace"):
    ``val/n_rollouts_w_trace``; ``val/turn_count`` (mean calls per rollout);
    ``val/mean_response_length_per_turn`` (mean over rollouts of their mean response tokens per
    call); ``val/mean_total_response_length_per_rollout`` (mean response tokens per rollout); NaN when
    no rollout has a trace. Plus ``rollout_metrics`` (``val/reward``, ``val/n_rollouts``),
    ``val/n_batches``, and the sources' counters (names whose last part starts with ``n_``) summed over
    the batches under ``val/`` instead of ``training/``: among them ``val/n_rollouts_w_reward`` (0 when
    none), which only the source knows, as a missing reward is filled before the rollouts get here.
    """
    metrics: dict[str, float] = {"val/n_rollouts_w_reward": 0.0}
    for batch in source_metrics:
        for name, value in batch.items():
            if name.startswith("training/") and name.rsplit("/", 1)[-1].startswith("n_"):
                key = "val/" + name[len("training/") :]
                metrics[key] = metrics.get(key, 0.0) + float(value)
    traced = [[len(t.response_ids) for t in r.triplets] for r in rollouts if r.triplets]
    nan = float("nan")
    metrics.update(
        {
            "val/n_rollouts_w_trace": float(len(traced)),
            "val/turn_count": float(np.mean([len(calls) for calls in traced])) if traced else nan,
            "val/mean_response_length_per_turn": float(np.mean([np.mean(calls) for calls in traced]))
            if traced
            else nan,
            "val/mean_total_response_length_per_rollout": float(np.mean([sum(calls) for calls in traced]))
            if traced
            else nan,
            "val/n_batches": float(len(source_metrics)),
            **rollout_metrics(rollouts, "val"),
        }
    )
    return metrics


def staleness_metrics(rollouts: Sequence[CompletedRollout], step: int) -> dict[str, float]:
    """How many weight updates behind the policy trained at ``step`` each trained model call was.

    A call records the ``version`` (training step) of the weights that served it; step ``step``
    updates the weights of version ``step - 1``, so a call's staleness is ``step - 1 - version``: 0
    when every call used the current weights (sync mode), more for calls carried over in async mode.
    Calls without a version are counted, not guessed.
    """
    lags, missing = [], 0
    for rollout in rollouts:
        for triplet in rollout.triplets:
            version = triplet.metadata.get("model_version")
            if isinstance(version, int) and not isinstance(version, bool):
                lags.append(step - 1 - version)
            else:
                missing += 1
    metrics = {"training/async/n_calls_wo_model_version": float(missing)}
    if lags:
        metrics["training/async/staleness_max_steps"] = float(max(lags))
        metrics["training/async/staleness_mean_steps"] = float(np.mean(lags))
        metrics["training/async/n_stale_calls"] = float(sum(lag > 0 for lag in lags))
    return metrics


@attrs.frozen
class PreparedBatch:
    """What one step trains on. ``shaped`` is ``None`` when nothing trainable survived shaping (the
    update is skipped and counted in ``training/n_skipped_updates``). ``row_scales`` holds each kept
    row's per-rollout normalisation factor, or ``None`` when the loss does not use one."""

    shaped: ShapedBatch | None
    row_scales: np.ndarray | None
    metrics: dict[str, float]

    def advantages(self, width: int) -> torch.Tensor:
        """The kept rows' advantages as a ``[rows, width]`` float32 tensor, right-padded like the
        responses and scaled per rollout when the loss uses it."""
        return self.scale(pad_responses(self._shaped().advantages, width, torch.float32))

    def scale(self, values: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
        """Per-row ``values`` (``[rows, ...]``: the kept rows in order, or kept rows ``rows``) times
        each row's per-rollout normalisation factor; unchanged when the loss uses none. The one place
        the factor is applied (a backend whose advantages come later, as verl's ``gae``, calls it too)."""
        if self.row_scales is None:
            return values
        scales = torch.as_tensor(self.row_scales, dtype=torch.float32)
        if rows is not None:
            scales = scales[list(rows)]
        return values * scales.reshape(-1, *[1] * (values.dim() - 1)).to(values.dtype)

    def returns(self, width: int) -> torch.Tensor:
        """The kept rows' returns (what a critic fits; never scaled), padded like :meth:`advantages`."""
        return pad_responses(self._shaped().returns, width, torch.float32)

    def _shaped(self) -> ShapedBatch:
        if self.shaped is None:
            raise UsageError("no trainable rows in this step: check PreparedBatch.shaped before asking for advantages")
        return self.shaped


def _scales_per_rollout(config: Any, plugins: Any) -> bool:
    """Whether the configured loss declares it needs advantages scaled per rollout (its
    :class:`~agl_core.stages.policy_loss.PolicyLossSpec`). A name agl does not register is a
    backend's own loss (verl's ``vanilla``...), which takes raw advantages."""
    loss_mode = str(config.actor_rollout_ref.actor.policy_loss.loss_mode)
    if loss_mode not in plugins.policy_losses:
        return False
    return policy_loss_spec(plugins.policy_losses.get(loss_mode)).scale_advantages_per_rollout


@attrs.frozen
class _RolloutPart:
    """What the pipeline does to one rollout alone before the batch meets: the rollout as received,
    as aggregated (without its out-of-vocabulary calls, ``removed`` of them) and its aggregation."""

    received: CompletedRollout
    kept: CompletedRollout
    removed: int
    aggregation: RolloutAggregation


def _without_lone_rollouts(rows: Sequence[TrainingRow]) -> tuple[list[TrainingRow], int]:
    """``rows`` without the groups left with a single rollout, and how many such groups there were.

    With ``rollout.n > 1`` a group of one is a group whose other rollouts failed, were skipped or
    lost every call to bad events: it has no baseline to compare against, so rather than let one bad
    rollout stop the run (group estimators refuse such groups), its rows are left out and counted.
    """
    rollouts_of: dict[str, set[str]] = {}
    for row in rows:
        rollouts_of.setdefault(row.group_id, set()).add(row.rollout_id)
    lone = {group for group, rollouts in rollouts_of.items() if len(rollouts) == 1}
    if not lone:
        return list(rows), 0
    return [row for row in rows if row.group_id not in lone], len(lone)


class StepPipeline:
    """Aggregator → advantage estimator (on every collected row) → batch shaping → normalisation.

    ``estimate`` overrides how advantages are computed (the verl backend routes verl-native estimator
    names through verl); by default the estimator named by ``algorithm.adv_estimator`` is used.
    Advantages are scaled per rollout when the loss named by
    ``actor_rollout_ref.actor.policy_loss.loss_mode`` declares ``scale_advantages_per_rollout``.
    Trajectory breaks are appended to ``agentlightning.trace_aggregator.mismatch_log_path`` when set.
    With a ``tokenizer`` (its ``len()`` is the vocabulary size), calls holding ids outside the
    vocabulary are removed first (:mod:`agl_core.stages.vocabulary`). With ``rollout.n > 1``, groups
    left with one rollout are removed before estimation (``training/n_groups_dropped_one_rollout_left``).
    With ``agentlightning.record_rollouts``, every step's rollouts are appended, as received, to the
    run's recording (:mod:`agl_core.files.recording`; ``training/record/bytes``) before anything else runs.
    Each :meth:`prepare` keeps the step's sample tables (:mod:`agl_core.stages.samples`) until the
    backend hands them on with :meth:`take_samples`.

    With an aggregator declared per rollout (:class:`~agl_core.stages.aggregation.PerRolloutAggregator`),
    the rollout source hands each training rollout to :meth:`prepare_rollout` as it finishes, so
    that rollout's vocabulary check and aggregation are done while the others still run; the
    batch's result is the same as without it.
    """

    __module__ = "agl_core"

    def __init__(
        self,
        config: Any,
        plugins: Any,
        tokenizer: Any = None,
        estimate: Callable[[Sequence[TrainingRow]], Advantages] | None = None,
    ):
        self.config = config
        aggregator = config.agentlightning.trace_aggregator
        self.aggregate = plugins.aggregators.get(aggregator.level)
        self.aggregation_settings = settings_from_config(config, tokenizer)
        self.mismatch_log_path = aggregator.mismatch_log_path
        self.group_size = int(config.actor_rollout_ref.rollout.n)
        self.vocab_size = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None
        if estimate is None:
            estimator = plugins.advantage_estimators.get(config.algorithm.adv_estimator)
            settings = AdvantageSettings.from_config(config)

            def estimate(rows: Sequence[TrainingRow]) -> Advantages:
                return estimator(rows, settings)

        self.estimate = estimate
        self.normalization = (
            str(config.agentlightning.loss_normalization) if _scales_per_rollout(config, plugins) else None
        )
        self._samples: dict[str, list[dict[str, Any]]] = {}
        self.recording = RecordingWriter(config, tokenizer) if config.agentlightning.record_rollouts else None
        self._parts: dict[str, _RolloutPart] = {}  # by rollout id, made by prepare_rollout
        self._parts_left_over: set[str] = set()  # not used by the last prepare

    def prepare_rollout(self, rollout: CompletedRollout) -> None:
        """Do the per-rollout part of the :meth:`prepare` that will get ``rollout`` now (what a rollout
        source calls as each training rollout finishes). Nothing to do unless the aggregator is
        declared per rollout; a rollout whose part fails is left to :meth:`prepare`, which fails on it
        exactly as without this call."""
        if not isinstance(self.aggregate, PerRolloutAggregator) or not rollout.is_train:
            return
        try:
            self._parts[rollout.rollout_id] = self._rollout_part(rollout)
        except Exception:  # raised again, in batch order, by prepare
            self._parts.pop(rollout.rollout_id, None)

    def _rollout_part(self, rollout: CompletedRollout) -> _RolloutPart:
        kept, removed = rollout, 0
        if self.vocab_size is not None:
            [kept], removed = within_vocabulary([rollout], self.vocab_size)
        return _RolloutPart(rollout, kept, removed, self.aggregate.aggregate_rollout(kept, self.aggregation_settings))

    def _aggregated(self, rollouts: Sequence[CompletedRollout]) -> tuple[list[CompletedRollout], int, Aggregation]:
        """The rollouts without their out-of-vocabulary calls, how many calls that removed, and their
        aggregation: from the parts :meth:`prepare_rollout` made for these very rollouts (the rest made
        now), or over the whole batch for an aggregator not declared per rollout."""
        if not isinstance(self.aggregate, PerRolloutAggregator):
            removed = 0
            if self.vocab_size is not None:
                rollouts, removed = within_vocabulary(rollouts, self.vocab_size)
            return list(rollouts), removed, self.aggregate(rollouts, self.aggregation_settings)
        parts = []
        for rollout in rollouts:
            part = self._parts.pop(rollout.rollout_id, None)
            parts.append(part if part is not None and part.received is rollout else self._rollout_part(rollout))
        # A part that waited through a whole step unused (its rollout never came) is let go.
        for rollout_id in self._parts_left_over & self._parts.keys():
            del self._parts[rollout_id]
        self._parts_left_over = set(self._parts)
        aggregation = self.aggregate.combine((p.aggregation for p in parts), self.aggregation_settings)
        return [p.kept for p in parts], sum(p.removed for p in parts), aggregation

    def take_samples(self) -> dict[str, list[dict[str, Any]]]:
        """The sample tables of the last :meth:`prepare` (``trajectories``, ``mismatches``), once:
        a second call, or one after a step without rollouts, returns ``{}``."""
        samples, self._samples = self._samples, {}
        return samples

    def prepare(self, rollouts: Sequence[CompletedRollout], step: int) -> PreparedBatch:
        """The step's trained batch from its completed rollouts: aggregate, estimate, shape, scale."""
        metrics = rollout_metrics(rollouts, "training")
        if self.recording is not None:
            metrics.update(self.recording.write(step, rollouts))
        metrics.update(staleness_metrics(rollouts, step))
        rollouts, removed, aggregation = self._aggregated(rollouts)
        if self.vocab_size is not None:
            metrics[OUT_OF_VOCAB_METRIC] = float(removed)
        metrics.update(aggregation.metrics)
        if self.mismatch_log_path and aggregation.mismatches:
            write_mismatches_jsonl(os.path.expanduser(self.mismatch_log_path), aggregation.mismatches)
        self._samples = step_samples(rollouts, aggregation.mismatches, step, self.aggregation_settings.tokenizer)
        rows = aggregation.rows
        if self.group_size > 1:
            rows, lone = _without_lone_rollouts(rows)
            metrics["training/n_groups_dropped_one_rollout_left"] = float(lone)
        metrics["training/n_sample"] = float(len(rows))
        shaped = None
        if rows:
            advantages = self.estimate(rows)
            metrics.update(advantages.metrics)
            shaped = shape_batch(rows, advantages, ShapingSettings.from_config(self.config, step))
            metrics.update(shaped.metrics)
        if shaped is None or shaped.n_mini_batches == 0:
            metrics["training/n_skipped_updates"] = 1.0
            return PreparedBatch(None, None, metrics)
        metrics["training/n_skipped_updates"] = 0.0
        scales = shaped.row_scales(self.normalization) if self.normalization else None
        return PreparedBatch(shaped, scales, metrics)
