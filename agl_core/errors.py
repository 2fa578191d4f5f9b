"""The root of every error agl raises on purpose: :class:`AglError`.

Each agl error also keeps the built-in class it had before (``ConfigError`` is a ``ValueError``,
``VllmEngineError`` a ``RuntimeError``...), so ``except ValueError`` still catches what it caught.
``agl`` prints an :class:`AglError` as one ``agl: error:`` line, then its class's :attr:`~AglError.hint`
when it has one; any other exception is reported as an internal error.

The public errors say they are ``agl_core``'s (``agl_core.ConfigError`` in a traceback), as pytest's
do. This module evaluates its annotations (no postponed annotations), so ``typing.get_type_hints`` of
any of them resolves ``hint`` in the namespace ``__module__`` names.
"""

from typing import ClassVar

__all__ = ["AglError"]


class AglError(Exception):
    """An error agl expects: its message says what is wrong and names the key, file, plugin or field."""

    __module__ = "agl_core"

    hint: ClassVar[str | None] = None
    """One line on what to try next, printed by ``agl`` after the error (``None``: nothing to add)."""
