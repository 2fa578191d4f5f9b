"""The step loop's schedule, written once: when to validate, report and checkpoint.

:func:`run_steps` drives a :class:`StepTrainer` (:class:`~agl_core.backends.loop_backend.LoopBackend`,
or a backend's own trainer that keeps agl's schedule) in this order: optionally a validation before
training, reported as the step it starts from (0 on a fresh run); then per step the next samples
(async, at the run's first step: batches until ``agentlightning.async_rollout.async_train_batch_size``
groups are in flight), the training step, a validation when ``trainer.test_freq`` divides the step or
it is the last, the step reported, and a checkpoint when ``trainer.save_freq`` divides the step or it
is the last. Beside that schedule, the trainer may ask (:class:`LoopControl`, read after each step) to
validate the step, checkpoint it, or end the run after it: a TRL callback's ``TrainerControl``, for one.

A step is reported before it is checkpointed: a run killed in between resumes from the previous
checkpoint, redoes the step, and the run log (:class:`agl_core.runs.train.MetricsLog`) replaces its line.
A step whose report stops the run (the consumer raises: ``agentlightning.max_untrained_steps`` steps
that trained nothing) still gets the checkpoint the schedule gives it, once the consumer closes the
loop, as verl's loop checkpoints a step before reporting it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs

__all__ = ["LoopControl", "LoopSettings", "Step", "StepTrainer", "next_samples", "run_steps"]

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
    a run hands the rollout source (async rollout), 0 for one batch. ``has_validation``: the run has
    validation rows, so a :class:`LoopControl` asking for a validation gets one."""

    total_steps: int
    test_freq: int = -1
    save_freq: int = -1
    validate_first: bool = False
    val_only: bool = False
    fill: int = 0
    has_validation: bool = True

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
            has_validation=has_validation,
        )


@attrs.frozen
class LoopControl:
    """What a trainer asks of the loop for the step it just trained, beside :class:`LoopSettings`'
    schedule: ``validate`` it, ``save`` (checkpoint) it, ``stop`` the run after it (validated, reported
    and, with ``trainer.save_freq`` > 0, checkpointed as a last step is). Read again after the step's
    validation, which may change it."""

    validate: bool = False
    save: bool = False
    stop: bool = False


def next_samples(trainer: StepTrainer, fill: int = 0) -> list[Mapping[str, Any]]:
    """One batch, or whole batches until there are at least ``fill`` samples (the async source keeps
    the groups it cannot start yet)."""
    samples = trainer.next_batch()
    while len(samples) < fill:
        samples = samples + trainer.next_batch()
    return samples


def run_steps(
    trainer: StepTrainer,
    settings: LoopSettings,
    control: Callable[[], LoopControl] = LoopControl,
    log: Callable[[Mapping[str, float]], None] | None = None,
) -> Iterator[Step]:
    """Train until ``settings.total_steps``, or until ``control()`` asks to stop, yielding each step's
    ``(step, total_steps, metrics)`` before it is checkpointed (the checkpoint is written when the next
    item is asked for, or when the loop is closed at that step). A run stopped early reports
    ``training/stopped_early`` on its last step. ``log`` gets each report's metrics first, before
    ``control()`` is read for the end of the run, so what it asks then applies to that step."""
    log = log or (lambda metrics: None)
    start, total = trainer.step, settings.total_steps
    if start >= total and not settings.val_only:
        logger.warning(
            "nothing to train: the run resumed at step %d of %d; raise trainer.total_training_steps, "
            "or start a new run in another trainer.default_local_dir",
            start,
            total,
        )
    if settings.validate_first and (start == 0 or settings.val_only):
        metrics = _validation(trainer)
        log(metrics)
        yield start, total, metrics
        if settings.val_only:
            return
    while trainer.step < total:
        started = time.perf_counter()
        metrics = trainer.train_step(next_samples(trainer, settings.fill if trainer.step == start else 0))
        metrics["timing/step_s"] = time.perf_counter() - started
        step = trainer.step
        last = step >= total or control().stop
        scheduled = settings.test_freq > 0 and (last or step % settings.test_freq == 0)
        if scheduled or (control().validate and _can_validate(settings, step)):
            metrics.update(_validation(trainer))
        log(metrics)
        stopped = step < total and control().stop  # a validation or the log may have asked for it
        if stopped:
            metrics["training/stopped_early"] = 1.0
            logger.warning("training stopped after step %d of %d: the trainer asked to stop", step, total)
        try:
            yield step, total, metrics
        finally:  # also when the consumer stops the run at this step (close(): a step that trained nothing)
            if (settings.save_freq > 0 and (last or stopped or step % settings.save_freq == 0)) or control().save:
                started = time.perf_counter()
                trainer.save()
                logger.info("checkpoint of step %d saved in %.2f s", step, time.perf_counter() - started)
        if stopped:
            return


def _can_validate(settings: LoopSettings, step: int) -> bool:
    if not settings.has_validation:
        logger.warning("step %d: the trainer asked for a validation, but data.val_files is not set", step)
    return settings.has_validation


def _validation(trainer: StepTrainer) -> dict[str, float]:
    started = time.perf_counter()
    metrics = trainer.validate()
    metrics["timing/val_s"] = time.perf_counter() - started
    return metrics
