"""Reading the JSON-lines files agl consumes (datasets) and writes (the run's metrics log)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from agl_core.errors import FileFormatError


def read_json_objects(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line of ``path``.

    Raises :class:`~agl_core.errors.FileFormatError` (a ``ValueError``) naming the file and line when a
    line is not valid JSON or not an object.
    """
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise FileFormatError(f"{os.fspath(path)} line {number} is not valid JSON: {exc.msg}") from None
            if not isinstance(record, dict):
                raise FileFormatError(
                    f"{os.fspath(path)} line {number} must be a JSON object, got {type(record).__name__}"
                )
            yield number, record
