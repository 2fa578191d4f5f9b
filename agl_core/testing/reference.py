"""Reference mode: compare a plugin with a slow, obviously-correct reference, showing where they differ.

Every contract suite takes an optional ``reference`` (the same signature as the plugin, written for
clarity rather than speed) and runs a differential property: on every generated input, plugin
and reference must agree. A mismatch is reported as a readable diff: which item, which positions,
the plugin's values beside the reference's. Hand-computed tables (``cases``) use the same diff.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agl_core.testing.snapshots import shorten

__all__ = ["array_diff", "mapping_diff"]

_SHOWN = 6  # differing positions listed in a diff


def array_diff(got: Any, want: Any, *, rtol: float = 1e-5, atol: float = 1e-6) -> str | None:
    """``None`` when ``got`` matches ``want`` (same shape, values within tolerance, NaN where NaN),
    else a few lines: the differing positions with both values, and how many differ."""
    got_a, want_a = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got_a.shape != want_a.shape:
        return (
            f"shape {got_a.shape}, the reference's {want_a.shape} (got {shorten(got_a)}, reference {shorten(want_a)})"
        )
    close = np.isclose(got_a, want_a, rtol=rtol, atol=atol, equal_nan=True)
    if close.all():
        return None
    where = np.argwhere(~close)
    lines = [
        f"  at {tuple(int(i) for i in index) if got_a.ndim != 1 else int(index[0])}: "
        f"got {got_a[tuple(index)]:.6g}, reference {want_a[tuple(index)]:.6g}"
        for index in where[:_SHOWN]
    ]
    more = f"\n  ... {len(where) - _SHOWN} more" if len(where) > _SHOWN else ""
    return f"{len(where)} of {got_a.size} values differ:\n" + "\n".join(lines) + more


def mapping_diff(
    got: Mapping[str, Any],
    want: Mapping[str, Any],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    keys: Sequence[str] | None = None,
) -> str | None:
    """``None`` when the numbers of ``got`` match ``want``'s (on ``keys``, default every key of
    either), else one line per differing or missing key."""
    lines = []
    for key in keys if keys is not None else sorted({*got, *want}):
        if key not in got or key not in want:
            lines.append(
                f"  {key}: {'missing' if key not in got else shorten(got[key])}, "
                f"reference {'missing' if key not in want else shorten(want[key])}"
            )
        elif not np.isclose(float(got[key]), float(want[key]), rtol=rtol, atol=atol, equal_nan=True):
            lines.append(f"  {key}: got {float(got[key]):.6g}, reference {float(want[key]):.6g}")
    return "\n".join(lines) or None
