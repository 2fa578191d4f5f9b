"""Steps that trained nothing: named as they happen, and a run that keeps training nothing stopped.

A step trained nothing when its update was skipped (``training/n_skipped_updates``, the step
pipeline's flag) or no row was trained (``training/n_sample_trained`` 0). :func:`untrained_reason`
says why from the step's own metrics (every rollout failed, no model call, every row dropped, and
for which reason); :class:`UntrainedSteps` warns with it at each such step, stops the run with
:class:`NothingTrainedError` once ``agentlightning.max_untrained_steps`` steps in a row trained
nothing, and fails a run that ends without having trained a step. A backend's metrics reach it
through ``on_step``, so it holds for every backend, and for ``agl replay``'s one step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from agl_core.errors import AglError

__all__ = ["NothingTrainedError", "UntrainedSteps", "untrained_reason"]

logger = logging.getLogger(__name__)

_DROPS = ("marked", "same_reward", "random")


class NothingTrainedError(AglError, RuntimeError):
    """A run (or a replayed step) trained nothing; the message says why, from the step's metrics."""

    __module__ = "agl_core"

    hint = (
        "the failed rollouts' errors are logged as 'N of M rollouts failed: ...' (embedded agents) or in "
        "the controller's log (the gateway); agentlightning.max_untrained_steps sets how many steps in a row "
        "may train nothing"
    )


def untrained_reason(metrics: Mapping[str, float]) -> str | None:
    """Why the step of ``metrics`` trained nothing, or ``None`` when it trained (or its metrics do
    not say: a validation-only report, a backend that reports neither flag)."""
    skipped = metrics.get("training/n_skipped_updates")
    trained = metrics.get("training/n_sample_trained")
    if not (skipped or trained == 0):
        return None
    count = lambda name: int(metrics.get(name) or 0)  # noqa: E731
    failed, kept = count("training/rollouts/n_failed"), count("training/n_rollouts")
    if failed and not kept:
        return f"every rollout failed ({failed} of {failed})"
    if not kept:
        return "no rollout came back"
    if not count("training/n_rollouts_w_trace"):
        return f"none of the {kept} rollouts made a model call with tokens (training/n_rollouts_w_trace 0)"
    if not count("training/n_sample"):
        return (
            f"the {kept} rollouts gave no training row (skipped without a trained token: "
            f"{count('training/n_skipped_empty_rows')}; a group left with one rollout: "
            f"{count('training/n_groups_dropped_one_rollout_left')})"
        )
    drops = ", ".join(f"{name} {count(f'training/n_sample_dropped/{name}')}" for name in _DROPS)
    return f"every one of the {count('training/n_sample')} rows was dropped before the update ({drops})"


class UntrainedSteps:
    """Watches each reported step; ``limit`` steps in a row that trained nothing stop the run (0: never)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row: list[int] = []  # the steps that trained nothing since the last that trained
        self.trained = False  # a step of the run trained
        self.last_reason: str | None = None  # why the last step that trained nothing did not

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        """Take step ``step``'s metrics: warn when it trained nothing, raise once ``limit`` such steps
        came in a row."""
        reason = untrained_reason(metrics)
        if reason is None:
            if "training/n_skipped_updates" in metrics or "training/n_sample_trained" in metrics:
                self.trained = True
                self.in_a_row.clear()
            return
        self.last_reason = reason
        self.in_a_row.append(step)
        logger.warning("step %d trained nothing: %s", step, reason)
        if self.limit and len(self.in_a_row) >= self.limit:
            first, last = self.in_a_row[0], self.in_a_row[-1]
            raise NothingTrainedError(
                f"steps {first} to {last} trained nothing ({len(self.in_a_row)} in a row, "
                f"agentlightning.max_untrained_steps={self.limit}); step {last}: {reason}"
            )

    def check_end(self) -> None:
        """At the end of a run: fail when it reported training steps and none of them trained."""
        if self.last_reason is not None and not self.trained:
            raise NothingTrainedError(
                f"the run trained nothing: no step of it trained a row; the last one: {self.last_reason}"
            )
