"""The root of every error agl raises on purpose, :class:`AglError`, and the errors of no one part.

Each agl error also keeps the built-in class it had before (``ConfigError`` is a ``ValueError``,
``VllmEngineError`` a ``RuntimeError``...), so ``except ValueError`` still catches what it caught.
``agl`` prints an :class:`AglError` as one ``agl: error:`` line, then its class's :attr:`~AglError.hint`
when it has one; any other exception is reported as an internal error.

The public errors say they are ``agl_core``'s (``agl_core.ConfigError`` in a traceback), as pytest's
do. This module evaluates its annotations (no postponed annotations), so ``typing.get_type_hints`` of
any of them resolves ``hint`` in the namespace ``__module__`` names.
"""

from typing import ClassVar

__all__ = ["AglError", "FileFormatError", "UsageError", "UsageTypeError"]

_CALLER_HINT = (
    "the message names what was passed; if your own code did not make this call, it is a bug in agl or a plugin: "
    "run again with --traceback to see where"
)


class AglError(Exception):
    """An error agl expects: its message says what is wrong and names the key, file, plugin or field."""

    __module__ = "agl_core"

    hint: ClassVar[str | None] = None
    """One line on what to try next, printed by ``agl`` after the error (``None``: nothing to add)."""

    def __reduce__(self) -> tuple:
        # Rebuilt from its message and attributes, not by calling ``__init__`` again: an error raised
        # in a Ray worker reaches the driver pickled, whatever arguments its class's ``__init__`` takes.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type, args: tuple, state: dict) -> AglError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class FileFormatError(AglError, ValueError):
    """A file agl reads does not hold what it must (a dataset, a metrics log, a checkpoint); the
    message names the file and, where there is one, the line, row or column."""

    __module__ = "agl_core"


class UsageError(AglError, ValueError):
    """A function or class of agl was given a value it cannot work with (out of range, sizes that
    do not match, a call out of order); the message names the argument, field or class attribute."""

    __module__ = "agl_core"

    hint = _CALLER_HINT


class UsageTypeError(AglError, TypeError):
    """A function or class of agl was given an object of a type it cannot work with; the message
    names the argument, field or class attribute and the type it got."""

    __module__ = "agl_core"

    hint = _CALLER_HINT
