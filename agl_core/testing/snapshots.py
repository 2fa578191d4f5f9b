"""Deep snapshots of a plugin's input, and a readable account of what changed between two of them.

A contract takes a snapshot before calling the plugin and another after: any difference, a
reordered list included, is a mutation. The message names the first place that changed (a path such
as ``rollouts[2] (id '…').triplets[0].response_ids[3]``) with the value before and after, so a
failing contract says what the plugin did, not only that it did something.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["describe_change", "shorten", "snapshot"]

_MAX_REPR = 80


def shorten(value: Any, limit: int = _MAX_REPR) -> str:
    """``repr(value)`` cut to ``limit`` characters (arrays shown as lists)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def snapshot(items: Sequence[Any]) -> list[Any]:
    """Plain nested data for every item, in order (``to_dict()`` where an item has it)."""
    return [_plain(item.to_dict() if hasattr(item, "to_dict") else item) for item in items]


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _first_difference(before: Any, after: Any, path: str) -> str | None:
    if isinstance(before, dict) and isinstance(after, dict):
        for key in [*before, *(k for k in after if k not in before)]:
            if key not in after:
                return f"{path}.{key} was removed (it was {shorten(before[key])})"
            if key not in before:
                return f"{path}.{key} was added ({shorten(after[key])})"
            found = _first_difference(before[key], after[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(before, list) and isinstance(after, list):
        for i, (b, a) in enumerate(zip(before, after)):
            found = _first_difference(b, a, f"{path}[{i}]")
            if found:
                return found
        if len(before) != len(after):
            return f"{path} had {len(before)} items, now {len(after)}"
        return None
    if before != after and not (before != before and after != after):  # NaN == NaN here
        return f"{path} was {shorten(before)}, now {shorten(after)}"
    return None


def describe_change(before: list[Any], after: list[Any], what: str, key: str) -> str | None:
    """What changed from snapshot ``before`` to ``after`` of a list of ``what`` identified by
    ``key`` (e.g. ``"rollout_id"``), or ``None`` when nothing did."""
    ids_before = [item.get(key) if isinstance(item, dict) else None for item in before]
    ids_after = [item.get(key) if isinstance(item, dict) else None for item in after]
    if len(before) != len(after):
        return (
            f"the list of {what} went from {len(before)} to {len(after)} items "
            f"({key}s before: {shorten(ids_before)}, after: {shorten(ids_after)})"
        )
    if ids_before != ids_after and sorted(map(str, ids_before)) == sorted(map(str, ids_after)):
        return (
            f"the {what} were reordered in place: "
            f"{key}s before {shorten(ids_before, 200)}, after {shorten(ids_after, 200)}"
        )
    for i, (b, a) in enumerate(zip(before, after)):
        found = _first_difference(b, a, f"{what}[{i}] ({key} {ids_before[i]!r})")
        if found:
            return found
    return None
