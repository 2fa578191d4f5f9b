"""Dataset files: the rows every backend turns into rollout groups (one JSON object per line)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agl_core.config import ConfigError
from agl_core.jsonl import read_json_objects

__all__ = ["load_dataset"]


def load_dataset(path: Any, key: str = "data.train_files") -> list[dict[str, Any]]:
    """The rows of a JSONL file (one JSON object per line; blank lines skipped), or of a list of
    them, concatenated in order (as verl concatenates a list of files)."""
    if not path:
        raise ConfigError(key, "no dataset file given")
    if isinstance(path, Sequence) and not isinstance(path, str):
        return [row for file in path for row in load_dataset(file, key)]
    if not isinstance(path, str):
        raise ConfigError(key, f"must be the path of a JSONL file or a list of them, got {path!r}")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(key, f"dataset file not found: {path}")
    try:
        rows = [row for _, row in read_json_objects(file)]
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None
    if not rows:
        raise ConfigError(key, f"{path} holds no rows")
    return rows
