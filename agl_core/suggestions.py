"""The one "did you mean" every error about an unknown name uses (hooks, registry entries, hook methods)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest", "misspelling_of", "suggest"]


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` was most likely meant to be, if one is close enough: the shortest that
    holds every word of ``name`` (``total_steps`` → ``total_training_steps``), else the closest spelling."""
    known = sorted(known)
    words = set(name.split("_"))
    if len(words) > 1:
        holding = [k for k in known if words <= set(k.split("_"))]
        if holding:
            return min(holding, key=len)
    close = difflib.get_close_matches(name, known, n=1)
    return close[0] if close else None


def suggest(name: str, known: Iterable[str]) -> str:
    """``did you mean 'x'?`` for the closest known name, else the list of known names."""
    known = sorted(known)
    match = closest(name, known)
    return f"did you mean {match!r}?" if match else f"known: {', '.join(known) or 'none'}"


def misspelling_of(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` looks like a misspelling of (``onSucceeded``, ``on_succeded`` and
    ``succeeded`` of ``on_succeeded``), compared without case or underscores; None if none is that
    close or ``name`` is itself known."""
    known = sorted(known)
    if name in known:
        return None
    loose = {_loose(k): k for k in known}
    match = difflib.get_close_matches(_loose(name), loose, n=1, cutoff=0.85)
    return loose[match[0]] if match else None


def _loose(name: str) -> str:
    return name.replace("_", "").lower()
