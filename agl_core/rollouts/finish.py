"""Finishing a terminal rollout, the same way for every source.

A finished rollout's events are parsed into a :class:`~agl_core.data.CompletedRollout`, the
``agl_on_succeeded`` / ``agl_on_failed`` hooks run on it, what they wrote through the
:class:`~agl_core.plugins.EventWriter` is stored, and the events are parsed again when anything was
stored, so a reward a hook wrote is the rollout's reward. Sources differ only in where events live:
they pass a ``store`` (append to the gateway, or to the recorded list) and a ``reread``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.plugins import EventWriter, PluginManager
from agl_core.rollouts.events import completed_rollout, events_by_attempt

__all__ = ["finish_rollout", "last_attempt_id"]


def last_attempt_id(events: list[dict[str, Any]]) -> str | None:
    """The ``attempt_id`` of the last event that names one (the gateway keeps every attempt's events)."""
    attempts = [
        e["attempt_id"]
        for e in events
        if isinstance(e, Mapping) and isinstance(e.get("attempt_id"), str) and e["attempt_id"]
    ]
    return attempts[-1] if attempts else None


def finish_rollout(
    request: RolloutRequest,
    events: list[dict[str, Any]],
    *,
    state: str,
    error: str | None,
    queued_at: float | None,
    attempt_id: str | None,
    reward_fillna_value: float,
    plugins: PluginManager,
    store: Callable[[EventWriter], int],
    reread: Callable[[], list[dict[str, Any]] | None] | None,
    counts: Counter[str],
) -> CompletedRollout:
    """The completed rollout for ``request``, after its lifecycle hooks.

    ``attempt_id`` ``None`` means the last attempt named in the events. The parser's anomaly counts
    of ``events`` and ``training/hooks/n_events_written`` (what ``store`` returned) go to ``counts``;
    a re-parse is not counted again. ``reread`` (``None``: never) gives the events after a store, or
    ``None`` when they cannot be read, which keeps the rollout as first parsed.
    """

    def parse(events: list[dict[str, Any]]) -> tuple[CompletedRollout, Counter[str]]:
        return completed_rollout(
            request,
            events,
            state=state,
            reward_fillna_value=reward_fillna_value,
            error=error,
            attempt_id=attempt_id if attempt_id is not None else last_attempt_id(events),
            queued_at=queued_at,
            ended_at=time.time(),
        )

    rollout, parsed_counts = parse(events)
    counts.update(parsed_counts)
    writer = EventWriter()
    if state == "succeeded":
        plugins.on_succeeded(rollout, events_by_attempt(events, rollout.attempt_id or "0"), writer)
    else:
        plugins.on_failed(rollout, writer)
    stored = store(writer)
    counts["training/hooks/n_events_written"] += stored
    if stored and reread is not None:
        events_now = reread()
        if events_now is not None:
            rollout, _ = parse(events_now)
    return rollout
