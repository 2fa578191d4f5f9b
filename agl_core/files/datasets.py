"""Dataset files: the rows every backend turns into rollout groups.

A dataset file is JSON lines (one object per line) or parquet (verl's format: one row per prompt,
with ``data_source``, ``prompt`` (chat messages), ``ability``, ``reward_model.ground_truth`` and
``extra_info`` columns, nested as structs and lists); ``data.train_files`` may list several, of
either kind. Parquet is told by its magic bytes, whatever the file's name, and read through a memory
map one row group at a time (:class:`ParquetRows`), so a large file is never held as Python objects.

Each row is a rollout's ``input``; ``agentlightning.local.env_map`` maps environment variables of the
agent to paths into it (:func:`env_from_map`; ``input.prompt.0.content``,
``input.reward_model.ground_truth``...), so :func:`check_datasets` checks every row has them
before anything runs: a missing field would otherwise fail every rollout of that row.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

from agl_core.config import ConfigError
from agl_core.errors import FileFormatError
from agl_core.files.jsonl import read_json_objects

__all__ = ["ParquetRows", "check_datasets", "env_from_map", "load_dataset"]

PARQUET_MAGIC = b"PAR1"


def load_dataset(path: Any, key: str = "data.train_files") -> Sequence[dict[str, Any]]:
    """The rows of a JSONL or parquet file, or of a list of them, concatenated in order (as verl
    concatenates a list of files). Parquet rows are read when indexed, a row group at a time."""
    parts = [(file, rows) for file, rows in _files(path, key)]
    if len(parts) == 1:
        return parts[0][1]
    return _Chain([rows for _, rows in parts])


def _files(path: Any, key: str) -> Iterator[tuple[str, Sequence[dict[str, Any]]]]:
    """``(file, its rows)`` for each file ``path`` names (one path or a list of them)."""
    if not path:
        raise ConfigError(key, "no dataset file given")
    if isinstance(path, Sequence) and not isinstance(path, str):
        for file in path:
            yield from _files(file, key)
        return
    if not isinstance(path, str):
        raise ConfigError(key, f"must be the path of a JSONL or parquet file or a list of them, got {path!r}")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(key, f"dataset file not found: {path}")
    with open(file, "rb") as f:
        parquet = f.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC
    try:
        rows: Sequence[dict[str, Any]] = ParquetRows(file) if parquet else [row for _, row in read_json_objects(file)]
    except UnicodeDecodeError as exc:
        raise ConfigError(key, f"{path} is neither JSON lines (UTF-8) nor parquet: {exc}") from None
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None
    if not rows:
        raise ConfigError(key, f"{path} holds no rows")
    yield path, rows


class ParquetRows(Sequence[dict[str, Any]]):
    """The rows of a parquet file as dicts (structs as dicts, lists as lists, maps as dicts), read
    from a memory map one row group at a time; the last row group read is kept.

    Opening checks that every column holds JSON-like values (a rollout input goes to the gateway as
    JSON): a binary, date, time or decimal column is a ``ValueError`` naming the file, the column
    and its first row holding such a value. Pickles as its path (reopened on first use).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file: Any = None
        self._cached: tuple[int, list[dict[str, Any]]] | None = None
        metadata = self._parquet().metadata
        self._starts = [0]
        for group in range(metadata.num_row_groups):
            self._starts.append(self._starts[-1] + metadata.row_group(group).num_rows)
        self._check_columns()

    def _parquet(self) -> Any:
        if self._file is None:
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                self._file = pq.ParquetFile(pa.memory_map(str(self.path)))
            except (pa.ArrowException, OSError) as exc:
                raise FileFormatError(f"{self.path} is not a readable parquet file: {exc}") from None
        return self._file

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None, "_cached": None}

    def __len__(self) -> int:
        return self._starts[-1]

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError(f"row {index} of {self.path}, which has {len(self)} rows")
        group = bisect.bisect_right(self._starts, position) - 1
        if self._cached is None or self._cached[0] != group:
            self._cached = (group, self._parquet().read_row_group(group).to_pylist(maps_as_pydicts="strict"))
        return self._cached[1][position - self._starts[group]]

    def batches(self, size: int = 1024) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """``(index of the first row, rows)`` through the whole file, ``size`` rows at a time."""
        start = 0
        for batch in self._parquet().iter_batches(batch_size=size):
            rows = batch.to_pylist(maps_as_pydicts="strict")
            yield start, rows
            start += len(rows)

    def _check_columns(self) -> None:
        import pyarrow.compute as pc

        schema = self._parquet().schema_arrow
        for field in schema:
            bad = _non_json_type(field.type)
            if bad is None:
                continue
            first = 0
            for batch in self._parquet().iter_batches(batch_size=4096, columns=[field.name]):
                valid = pc.index(batch.column(0).is_valid(), True).as_py()
                if valid >= 0:
                    first += valid
                    break
                first += batch.num_rows
            raise FileFormatError(
                f"{self.path} row {first + 1}, column {field.name!r}: holds {bad} values ({field.type}), which a "
                "rollout input (sent as JSON) cannot carry; convert the column to strings or numbers"
            )


def _non_json_type(arrow_type: Any) -> str | None:
    """The name of the first type within ``arrow_type`` without a JSON form, or None."""
    import pyarrow.types as t

    if t.is_struct(arrow_type):
        return next((bad for bad in (_non_json_type(f.type) for f in arrow_type) if bad), None)
    if t.is_list(arrow_type) or t.is_large_list(arrow_type) or t.is_fixed_size_list(arrow_type):
        return _non_json_type(arrow_type.value_type)
    if t.is_map(arrow_type):
        return _non_json_type(arrow_type.key_type) or _non_json_type(arrow_type.item_type)
    if t.is_dictionary(arrow_type):
        return _non_json_type(arrow_type.value_type)
    if t.is_null(arrow_type) or t.is_boolean(arrow_type) or t.is_integer(arrow_type) or t.is_floating(arrow_type):
        return None
    if t.is_string(arrow_type) or t.is_large_string(arrow_type):
        return None
    return str(arrow_type)


class _Chain(Sequence[dict[str, Any]]):
    """Several files' rows as one sequence, without copying them."""

    def __init__(self, parts: list[Sequence[dict[str, Any]]]):
        self.parts = parts
        self._starts = [0]
        for rows in parts:
            self._starts.append(self._starts[-1] + len(rows))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        part = bisect.bisect_right(self._starts, position) - 1
        return self.parts[part][position - self._starts[part]]


def env_from_map(task_input: Any, env_map: Mapping[str, str]) -> dict[str, str]:
    """The controller's ``local.env_map``: ``input`` / ``input.a.0.b`` paths into the rollout input
    (strings as they are, other values as JSON); anything else is a literal value. A missing path is a
    ``KeyError(message, variable)``."""
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
                    raise KeyError(
                        f"agentlightning.local.env_map.{name}: path {path!r} not found in the rollout input", name
                    )
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
    :class:`ConfigError` naming the key, the file, the row and the variable (and for a parquet file
    the column the path starts in). Parquet files are read in batches, never whole."""
    counts = {}
    env_map = dict(config.agentlightning.local.env_map) if check_env_map else {}
    for key in ("data.train_files", "data.val_files"):
        files = config.data.train_files if key == "data.train_files" else config.data.val_files
        if key == "data.val_files" and not files:
            continue
        counts[key] = 0
        for file, rows in _files(files, key):
            batches = rows.batches() if isinstance(rows, ParquetRows) else [(0, rows)]
            for start, batch in batches:
                for offset, row in enumerate(batch):
                    try:
                        env_from_map(row, env_map)
                    except KeyError as exc:
                        parts = env_map[exc.args[1]].split(".")
                        column = f" (column {parts[1]!r})" if isinstance(rows, ParquetRows) and len(parts) > 1 else ""
                        raise ConfigError(
                            key, f"row {start + offset + 1} of {len(rows)} of {file}{column}: {exc.args[0]}"
                        ) from None
            counts[key] += len(rows)
    return counts
