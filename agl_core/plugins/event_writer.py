"""The buffer through which lifecycle hooks append events to a rollout.

It has Agent Lightning's ``TraceWriter`` shape (``add_event(rollout_id, attempt_id, event_type,
data)``) so v1.0 hook files work unchanged. Events are only queued while the hook runs; the rollout
source flushes them after the hook returns, so a hook that raises half-way (or is abandoned after
its time limit) writes nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import attrs

from agl_core.errors import UsageError, UsageTypeError


@attrs.frozen
class PendingEvent:
    rollout_id: str
    attempt_id: str
    event_type: str
    data: dict[str, Any]


class EventWriter:
    __module__ = "agl_core"

    def __init__(self) -> None:
        self._pending: list[PendingEvent] = []

    def add_event(self, rollout_id: str, attempt_id: str, event_type: str, data: dict[str, Any]) -> None:
        if not isinstance(event_type, str) or not event_type:
            raise UsageError(f"event_type must be a non-empty string, got {event_type!r}")
        if not isinstance(data, dict):
            raise UsageTypeError(f"event data must be a dict, got {type(data).__name__}")
        self._pending.append(PendingEvent(str(rollout_id), str(attempt_id), event_type, copy.deepcopy(data)))

    @property
    def pending(self) -> tuple[PendingEvent, ...]:
        return tuple(self._pending)

    def discard(self, keep: int = 0) -> int:
        """Drop the queued events after the first ``keep`` (all by default); return how many went.

        The plugin manager gives each hook call a writer of its own and discards it when the hook
        raises or overruns its time limit, so a failing hook writes nothing.
        """
        dropped = len(self._pending) - keep
        del self._pending[keep:]
        return max(dropped, 0)

    def flush(self, post: Callable[[PendingEvent], Any]) -> int:
        """Send every queued event through ``post`` in order; return how many were sent.

        An event that ``post`` fails to send stays queued (with those after it) so the caller may
        retry the flush.
        """
        sent = 0
        while self._pending:
            post(self._pending[0])
            self._pending.pop(0)
            sent += 1
        return sent
