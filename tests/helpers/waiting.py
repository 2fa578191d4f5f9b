"""Waiting for something a test caused, bounded: never a fixed sleep that a loaded machine outlasts.

A test that needs another thread or process to reach a state polls for that state with
:func:`wait_until`; the bound is generous (minutes, not the expected seconds) and its failure says
what never happened, so a slow machine makes the test slower, never wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PATIENCE_S = 120.0
"""How long a test waits for something that normally takes a second or two."""


def wait_until(condition: Callable[[], object], what: str, timeout: float = PATIENCE_S, interval: float = 0.02) -> None:
    """Return once ``condition()`` is true; fail with ``what`` (what never happened) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(interval)
