"""The step loop's schedule, written once: when to validate, report and checkpoint.

:func:`run_steps` drives a :class:`StepTrainer` (:class:`~agl_core.backends.loop_backend.LoopBackend`,
or a backend's own trainer that keeps agl's schedule) in this order: optionally a validation before
training, reported as the step it starts from (0 on a fresh run); then per step the next samples
(async, at the run's first step: batches until ``agentlightning.async_rollout.async_train_batch_size``
groups are in flight), the training step, a validation when ``trainer.test_freq`` divides the step or
it is the last, the step reported, and a checkpoint when ``trainer.save_freq`` divides the step or it
is the last.

A step is reported before it is checkpointed: a run killed in between resumes from the previous
checkpoint, redoes the step, and the run log (:class:`agl_core.runs.train.MetricsLog`) replaces its line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs

__all__ = ["LoopSettings", "Step", "StepTrainer", "next_samples", "run_steps"]

logger = logging.getLogger(__name__)

Step = tuple[int, int, dict[str, float]]
"""``(step, total_steps, metrics)``, as :data:`agl_core.backends.contract.OnStep` receives them."""


class StepTrainer(Protocol):
    @property
    def step(self) -> int:
        """Training steps done: 0 on a fresh run, the checkpoint's step on a resumed one."""

    def next_batch(self) -> list[Mapping[str, Any]]:
        """The next dataset batch; the data position advances, so a checkpoint records it."""

    def train_step(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Train step ``step + 1`` on ``samples`` (rollouts, update, new weights served) and advance
        ``step``; the step's metrics."""

    def validate(self) -> dict[str, float]:
        """One validation pass with the current weights; its ``val/*`` metrics."""

    def save(self) -> None:
        """Checkpoint step ``step``."""


@attrs.frozen
class LoopSettings:
    """``validate_first``: validate before training on a fresh run; with ``val_only`` (verl's
    ``trainer.val_only``) also on a resumed one, and stop there. ``fill``: samples the first step of
    a run hands the rollout source (async rollout), 0 for one batch."""

    total_steps: int
    test_freq: int = -1
    save_freq: int = -1
    validate_first: bool = False
    val_only: bool = False
    fill: int = 0

    @classmethod
    def from_config(
        cls, config: Any, total_steps: int, *, has_validation: bool = True, val_only: bool = False
    ) -> LoopSettings:
        """The settings of a run config (``trainer.*``, ``agentlightning.async_rollout.*``)."""
        async_rollout = config.agentlightning.async_rollout
        return cls(
            total_steps=total_steps,
            test_freq=int(config.trainer.test_freq) if has_validation else -1,
            save_freq=int(config.trainer.save_freq),
            validate_first=has_validation and bool(config.trainer.val_before_train),
            val_only=val_only,
            fill=int(async_rollout.async_train_batch_size) if async_rollout.enabled else 0,
        )


def next_samples(trainer: StepTrainer, fill: int = 0) -> list[Mapping[str, Any]]:
    """One batch, or whole batches until there are at least ``fill`` samples (the async source keeps
    the groups it cannot start yet)."""
    samples = trainer.next_batch()
    while len(samples) < fill:
        samples = samples + trainer.next_batch()
    return samples


def run_steps(trainer: StepTrainer, settings: LoopSettings) -> Iterator[Step]:
    """Train until ``settings.total_steps``, yielding each step's ``(step, total_steps, metrics)``
    before it is checkpointed (the checkpoint is written when the next item is asked for)."""
    start, total = trainer.step, settings.total_steps
    if start >= total and not settings.val_only:
        logger.warning(
            "nothing to train: the run resumed at step %d of %d; raise trainer.total_training_steps, "
            "or start a new run in another trainer.default_local_dir",
            start,
            total,
        )
    if settings.validate_first and (start == 0 or settings.val_only):
        yield start, total, _validation(trainer)
        if settings.val_only:
            return
    while trainer.step < total:
        started = time.perf_counter()
        metrics = trainer.train_step(next_samples(trainer, settings.fill if trainer.step == start else 0))
        metrics["timing/step_s"] = time.perf_counter() - started
        step = trainer.step
        last = step >= total
        if settings.test_freq > 0 and (last or step % settings.test_freq == 0):
            metrics.update(_validation(trainer))
        yield step, total, metrics
        if settings.save_freq > 0 and (last or step % settings.save_freq == 0):
            started = time.perf_counter()
            trainer.save()
            logger.info("checkpoint of step %d saved in %.2f s", step, time.perf_counter() - started)


def _validation(trainer: StepTrainer) -> dict[str, float]:
    started = time.perf_counter()
    metrics = trainer.validate()
    metrics["timing/val_s"] = time.perf_counter() - started
    return metrics
