"""The built-in aggregators, ``transition`` and ``trajectory``, registered as an ordinary plugin.

``transition`` makes one row per call. ``trajectory`` merges consecutive calls of a rollout into
one row while each call's prompt extends the context (the previous call's prompt + response)
exactly; the prompt's tail is the observation (tool output, user turn, template tokens), appended
untrained. Any other call starts a new row, and the break is classified (:mod:`agl_core.stages.mismatch`);
so does a call whose images (``Triplet.image_urls``) do not start with the previous call's, a break
of kind ``images``. A row's images are its first call's, then each merged call's new ones.

:func:`aggregate_trajectories` takes the merge test as an argument, so an aggregator with its own
idea of "this call continues the context" keeps everything else — limits, counts, mismatch
sample — identical. Both built-ins are declared :class:`~agl_core.stages.aggregation.PerRolloutAggregator` objects
over :func:`trajectory_rollout` / :func:`transition_rollout`: a rollout's rows depend on it alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from agl_core.data import CompletedRollout, Triplet
from agl_core.hookspecs import hookimpl
from agl_core.stages.aggregation import (
    Aggregation,
    AggregationCounts,
    AggregationSettings,
    PerRolloutAggregator,
    RolloutAggregation,
    Segment,
    merged_row,
    rollout_reward,
)
from agl_core.stages.mismatch import MismatchLog

__all__ = [
    "Align",
    "aggregate_trajectories",
    "exact_prefix",
    "trajectory",
    "trajectory_rollout",
    "transition",
    "transition_rollout",
]

# align(previous call, next call's prompt ids, settings) -> where the observation starts in the
# prompt, or None when the prompt does not continue the context (a break).
Align = Callable[[Triplet, np.ndarray, AggregationSettings], "int | None"]

_NO_OBSERVATION = np.zeros(0, dtype=np.int64)
_NO_OBSERVATION.flags.writeable = False


def exact_prefix(previous: Triplet, prompt_ids: np.ndarray, settings: AggregationSettings) -> int | None:
    """The context's length when ``prompt_ids`` starts with it id for id, else ``None``."""
    n_prompt, n_response = len(previous.prompt_ids), len(previous.response_ids)
    end = n_prompt + n_response
    if len(prompt_ids) < end:
        return None
    # Same lengths by construction, so a plain element-wise comparison decides (array_equal's
    # checks cost more than the comparison on most prompts).
    if (prompt_ids[:n_prompt] == previous.prompt_ids).all() and (
        prompt_ids[n_prompt:end] == previous.response_ids
    ).all():
        return end
    return None


def trajectory_rollout(
    rollout: CompletedRollout, settings: AggregationSettings, align: Align = exact_prefix
) -> RolloutAggregation:
    """One rollout's rows, merging its calls wherever ``align`` says a call continues the context."""
    counts = AggregationCounts()
    log = MismatchLog(settings, counts)
    rows = []

    def close(segments: list[Segment]) -> None:
        row = merged_row(rollout, segments, settings, counts)
        if row is not None:
            rows.append(row)

    rollout_reward(rollout)
    counts.add_rollout(rollout)
    calls = rollout.triplets
    if not calls:
        return RolloutAggregation(rows, counts)
    segments = [Segment(0, calls[0], _NO_OBSERVATION)]
    n_rows = 1
    for index in range(1, len(calls)):
        previous, call = calls[index - 1], calls[index]
        # The row's images are the previous call's: a call whose images do not start with them
        # (the history's images edited or removed) cannot continue the row, whatever its ids.
        same_images = call.image_urls[: len(previous.image_urls)] == previous.image_urls
        start = align(previous, call.prompt_ids, settings) if same_images else None
        if start is None:
            log.record(rollout, index, previous, call.prompt_ids, kind=None if same_images else "images")
            close(segments)
            segments = [Segment(index, call, _NO_OBSERVATION)]
            n_rows += 1
        else:
            segments.append(Segment(index, call, call.prompt_ids[start:]))
    close(segments)
    if n_rows > 1:
        counts.unmerged_rollout()
    return RolloutAggregation(rows, counts, log.sample)


def aggregate_trajectories(
    rollouts: Sequence[CompletedRollout], settings: AggregationSettings, align: Align = exact_prefix
) -> Aggregation:
    """Merge each rollout's calls into rows wherever ``align`` says a call continues the context.
    (Registered as is, an aggregator built on it gets the whole batch; one registered as
    ``PerRolloutAggregator(functools.partial(trajectory_rollout, align=align), trajectory=True)``
    gives the same result aggregated as each rollout finishes.)"""
    return PerRolloutAggregator(functools.partial(trajectory_rollout, align=align), trajectory=True)(rollouts, settings)


def transition_rollout(rollout: CompletedRollout, settings: AggregationSettings) -> RolloutAggregation:
    """One row per call of ``rollout``, each carrying the rollout's final reward."""
    counts = AggregationCounts()
    rollout_reward(rollout)
    counts.add_rollout(rollout)
    rows = []
    for index, call in enumerate(rollout.triplets):
        row = merged_row(rollout, [Segment(index, call, _NO_OBSERVATION)], settings, counts)
        if row is not None:
            rows.append(row)
    return RolloutAggregation(rows, counts)


# Both built-ins declare that they work on each rollout alone, so the step pipeline aggregates each
# rollout as it finishes.
trajectory = PerRolloutAggregator(trajectory_rollout, trajectory=True, name="trajectory")
"""Merge calls whose prompt extends the context exactly (Agent Lightning's default level)."""
transition = PerRolloutAggregator(transition_rollout, name="transition")
"""One row per call, each carrying the rollout's final reward."""


@hookimpl
def agl_register_aggregators(register):
    register("transition", transition)
    register("trajectory", trajectory)
