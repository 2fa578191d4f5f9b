"""``one_row_per_call``: agl's trajectory aggregation with a merge test that never merges."""

from __future__ import annotations

from collections.abc import Sequence

from agl_core import Aggregation, AggregationSettings, CompletedRollout, aggregate_trajectories, hookimpl

__all__ = ["one_row_per_call"]


def one_row_per_call(rollouts: Sequence[CompletedRollout], settings: AggregationSettings) -> Aggregation:
    return aggregate_trajectories(rollouts, settings, align=lambda previous, prompt_ids, settings: None)


@hookimpl
def agl_register_aggregators(register):
    register("one_row_per_call", one_row_per_call)
