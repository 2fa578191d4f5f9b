"""Rollouts as a stream of finished groups, whatever the source: the form a backend needs when its
own loop schedules rollouts (verl's agent-loop slot) instead of asking for a step's batch.

A :class:`GroupStream` starts rollouts with :meth:`~GroupStream.submit` and hands each group over
once all its rollouts are terminal (:meth:`~GroupStream.finished_groups`). The gateway source
streams natively (each group as the gateway finishes it); :func:`group_stream` wraps any other
source (embedded, replay) in :class:`CollectStream`, which collects one submission at a time.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from agl_core.data import CompletedRollout
from agl_core.errors import UsageError
from agl_core.rollouts.source import FinishedGroup, RolloutSource, new_id

__all__ = ["CollectStream", "GroupStream", "group_stream"]


@runtime_checkable
class GroupStream(Protocol):
    poll_interval: float
    """Seconds to wait before the next :meth:`finished_groups` when it returned nothing."""
    runs_in_poll: bool
    """Whether :meth:`finished_groups` runs the rollouts itself (and so calls the model) rather than
    only reading what finished: a consumer must not call it while the model's weights are swapped."""

    def submit(
        self,
        samples: Sequence[Mapping[str, Any]],
        *,
        step: int,
        is_train: bool,
        group_ids: Sequence[str] | None = None,
    ) -> list[str]:
        """Start one group per sample (ids ``group_ids`` when given) without waiting; their ids."""

    def finished_groups(self) -> list[FinishedGroup]:
        """The submitted groups that finished since the last call, possibly none."""

    def pop_counts(self) -> dict[str, float]:
        """What the source counted since the last call (summable counts; rollout timings are the
        consumer's to compute over the rollouts it uses)."""

    def n_pending(self) -> int:
        """Rollouts started and not yet terminal."""


class CollectStream:
    """A batch source as a :class:`GroupStream`: each submission is collected whole, in order, by
    :meth:`finished_groups`; groups are matched to submitted ids by sample index."""

    poll_interval = 0.0
    runs_in_poll = True

    def __init__(self, source: RolloutSource, n: int):
        self.source, self.n = source, n
        self.queued: deque[tuple[list[Mapping[str, Any]], int, bool, list[str]]] = deque()
        self.counts: Counter[str] = Counter()

    def submit(
        self,
        samples: Sequence[Mapping[str, Any]],
        *,
        step: int,
        is_train: bool,
        group_ids: Sequence[str] | None = None,
    ) -> list[str]:
        if group_ids is not None and len(group_ids) != len(samples):
            raise UsageError(f"{len(samples)} samples but {len(group_ids)} group ids")
        ids = [new_id() for _ in samples] if group_ids is None else [str(g) for g in group_ids]
        self.queued.append((list(samples), step, is_train, ids))
        return ids

    def finished_groups(self) -> list[FinishedGroup]:
        if not self.queued:
            return []
        samples, step, is_train, ids = self.queued.popleft()
        batch = self.source.collect(samples, step=step, is_train=is_train)
        self.counts.update({k: v for k, v in batch.metrics.items() if not k.startswith("timing/rollout_")})
        by_sample: defaultdict[int, list[CompletedRollout]] = defaultdict(list)
        for rollout in batch.rollouts:
            by_sample[rollout.sample_index].append(rollout)
        size = self.n if is_train else 1
        return [
            FinishedGroup(group_id, step, is_train, size, [attrs.evolve(r, group_id=group_id) for r in by_sample[i]])
            for i, group_id in enumerate(ids)
        ]

    def pop_counts(self) -> dict[str, float]:
        counts = {k: float(v) for k, v in self.counts.items()}
        self.counts.clear()
        return counts

    def n_pending(self) -> int:
        return sum(len(samples) * (self.n if is_train else 1) for samples, _, is_train, _ in self.queued)


def group_stream(source: RolloutSource, n: int) -> GroupStream:
    """``source`` itself when it streams groups, else a ``CollectStream`` over it (``n``:
    rollouts per training group)."""
    return source if isinstance(source, GroupStream) else CollectStream(source, n)
