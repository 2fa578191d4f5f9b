"""A plugin that keeps the ledger of the rollout lifecycle hooks, for tests of a rollout source or a
backend: every rollout whose end a hook sees must have been enqueued before it, and ended once.

Register a :class:`LifecycleLedger` with the run's plugins, run, then ``assert ledger.problems() == []``
(:meth:`LifecycleLedger.problems` names each rollout that broke the rule) and compare its counts with
the trainer's metrics.
"""

from __future__ import annotations

import threading
from collections import Counter

from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.hookspecs import hookimpl

__all__ = ["LifecycleLedger"]


class LifecycleLedger:
    """Records the ids ``agl_on_enqueue``, ``agl_on_succeeded`` and ``agl_on_failed`` are called with."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # lifecycle hooks may be called from the source's reader threads
        self.enqueued: list[str] = []
        self.ended: list[tuple[str, str]] = []  # (rollout id, "succeeded" | "failed"), in call order

    @hookimpl
    def agl_on_enqueue(self, request: RolloutRequest) -> None:
        with self._lock:
            self.enqueued.append(request.rollout_id)

    @hookimpl
    def agl_on_succeeded(self, rollout: CompletedRollout) -> None:
        with self._lock:
            self.ended.append((rollout.rollout_id, "succeeded"))

    @hookimpl
    def agl_on_failed(self, rollout: CompletedRollout) -> None:
        with self._lock:
            self.ended.append((rollout.rollout_id, "failed"))

    def counts(self) -> Counter[str]:
        """Calls per hook: ``enqueued``, ``succeeded``, ``failed``."""
        with self._lock:
            return Counter({"enqueued": len(self.enqueued)}) + Counter(outcome for _, outcome in self.ended)

    def problems(self) -> list[str]:
        """What broke the lifecycle: an end for a rollout never enqueued, a rollout enqueued twice or
        ended twice. Empty when every end was of a rollout enqueued once and ended once."""
        with self._lock:
            enqueued, ended = Counter(self.enqueued), Counter(rid for rid, _ in self.ended)
        found = [f"rollout {rid} ended without being enqueued" for rid in ended if rid not in enqueued]
        found += [f"rollout {rid} enqueued {n} times" for rid, n in enqueued.items() if n > 1]
        found += [f"rollout {rid} ended {n} times" for rid, n in ended.items() if n > 1]
        return found
