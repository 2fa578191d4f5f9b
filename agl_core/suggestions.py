"""The one "did you mean" every error about an unknown name uses (hooks, registry entries, hook methods)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest", "suggest"]


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` was most likely meant to be, if one is close enough."""
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return close[0] if close else None


def suggest(name: str, known: Iterable[str]) -> str:
    """``did you mean 'x'?`` for the closest known name, else the list of known names."""
    known = sorted(known)
    match = closest(name, known)
    return f"did you mean {match!r}?" if match else f"known: {', '.join(known) or 'none'}"
