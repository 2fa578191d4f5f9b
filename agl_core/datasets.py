"""Dataset files: the rows every backend turns into rollout groups (one JSON object per line).

Each row is a rollout's ``input``; ``agentlightning.local.env_map`` maps environment variables of the
agent to paths into it (:func:`env_from_map`), so :func:`check_datasets` checks every row has them
before anything runs: a missing field would otherwise fail every rollout of that row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_core.config import ConfigError
from agl_core.jsonl import read_json_objects

__all__ = ["check_datasets", "env_from_map", "load_dataset"]


def load_dataset(path: Any, key: str = "data.train_files") -> list[dict[str, Any]]:
    """The rows of a JSONL file (one JSON object per line; blank lines skipped), or of a list of
    them, concatenated in order (as verl concatenates a list of files)."""
    if not path:
        raise ConfigError(key, "no dataset file given")
    if isinstance(path, Sequence) and not isinstance(path, str):
        return [row for file in path for row in load_dataset(file, key)]
    if not isinstance(path, str):
        raise ConfigError(key, f"must be the path of a JSONL file or a list of them, got {path!r}")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(key, f"dataset file not found: {path}")
    try:
        rows = [row for _, row in read_json_objects(file)]
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None
    if not rows:
        raise ConfigError(key, f"{path} holds no rows")
    return rows


def env_from_map(task_input: Any, env_map: Mapping[str, str]) -> dict[str, str]:
    """The controller's ``local.env_map``: ``input`` / ``input.a.0.b`` paths into the rollout input
    (strings as they are, other values as JSON); anything else is a literal value."""
    env = {}
    for name, path in env_map.items():
        value: Any = path
        if path == "input" or path.startswith("input."):
            value = task_input
            for part in path.split(".")[1:]:
                if isinstance(value, Mapping) and part in value:
                    value = value[part]
                elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
                    value = value[int(part)]
                else:
                    raise KeyError(f"agentlightning.local.env_map.{name}: path {path!r} not found in the rollout input")
        env[name] = value if isinstance(value, str) else json.dumps(_plain(value))
    return env


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def check_datasets(config: Any, check_env_map: bool = True) -> dict[str, int]:
    """Read ``data.train_files`` and (when set) ``data.val_files``; with ``check_env_map``, every row
    must hold the fields ``agentlightning.local.env_map`` names. Returns the rows per key; raises a
    :class:`ConfigError` naming the key, the row and the variable."""
    counts = {}
    env_map = dict(config.agentlightning.local.env_map) if check_env_map else {}
    for key in ("data.train_files", "data.val_files"):
        files = config.data.train_files if key == "data.train_files" else config.data.val_files
        if key == "data.val_files" and not files:
            continue
        listed = isinstance(files, Sequence) and not isinstance(files, str)
        counts[key] = 0
        for file in (files or [None]) if listed else [files]:
            rows = load_dataset(file, key)
            where = f" of {file}" if listed else ""  # which file of the list holds the row
            for index, row in enumerate(rows):
                try:
                    env_from_map(row, env_map)
                except KeyError as exc:
                    raise ConfigError(key, f"row {index + 1} of {len(rows)}{where}: {exc.args[0]}") from None
            counts[key] += len(rows)
    return counts
