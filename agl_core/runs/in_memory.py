"""Training from a config and datasets held in memory, as an Agent Lightning v1.0 script does.

A v1.0 script builds its config in code (a dict, or the ``DictConfig`` Hydra composes from its verl
config) and its datasets as lists of rows, then calls ``agentlightning.verl.entrypoint.run_ppo(config,
train_dataset=..., val_dataset=...)``. :func:`run_ppo` takes the same arguments and trains like
``agl train``: the config loads as a file would under the backend it names (``agentlightning.backend``;
the torch backend by default), every error names its key before anything starts, and each step is
logged to the run log and the ``trainer.logger`` sinks.

The datasets are written to the run directory (``datasets/train.jsonl``, ``datasets/val.jsonl``) and
named in ``data.train_files`` / ``data.val_files``, so the run reads them as any run reads its files,
a resumed run finds the rows it trained on, and the run directory says what they were. Rows must be
mappings of JSON values; numpy arrays and scalars (what pandas gives for parquet columns) are written
as lists and numbers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from agl_core.config import ConfigError, ConfigFile
from agl_core.errors import UsageTypeError
from agl_core.runs.run_config import resolve_config
from agl_core.runs.train import run_resolved

__all__ = ["IN_MEMORY", "run_ppo", "write_dataset"]

logger = logging.getLogger(__name__)

IN_MEMORY = "the config given to run_ppo"
DATASETS = "datasets"


def _json_value(value: Any) -> Any:
    """What ``json`` cannot write itself: numpy arrays and scalars (duck-typed, numpy is not needed)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise UsageTypeError(f"a {type(value).__name__} is not a JSON value")


def write_dataset(rows: Sequence[Mapping[str, Any]], path: Path, name: str) -> Path:
    """Write ``rows`` to ``path`` as JSON lines; a row that is not a mapping of JSON values is an error
    naming ``name`` (the argument) and the row."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise ConfigError(name, f"must be a sequence of rows (mappings), got {type(rows).__name__}")
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as out:
        for index, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise ConfigError(name, f"row {index} must be a mapping, got {type(row).__name__}")
            try:
                out.write(json.dumps(dict(row), ensure_ascii=False, default=_json_value) + "\n")
            except (TypeError, ValueError) as exc:
                raise ConfigError(name, f"row {index} cannot be written as JSON: {exc}") from None
            n += 1
    if not n:
        raise ConfigError(name, "is empty: give at least one row")
    return path


def run_ppo(
    config: Mapping[str, Any] | DictConfig,
    train_dataset: Sequence[Mapping[str, Any]],
    val_dataset: Sequence[Mapping[str, Any]] | None = None,
    *,
    overrides: Sequence[str] = (),
    plugins: Iterable[Any] = (),
    show_progress: bool = True,
) -> Path:
    """Train on ``train_dataset`` (and validate on ``val_dataset``) as ``config`` says; return the run
    directory. ``config`` is a dict or ``DictConfig`` in the layout of a config file, read under
    the backend it names; ``overrides`` are ``key=value`` strings applied over it, as on the command
    line. The datasets replace ``data.train_files`` / ``data.val_files`` where the config names files."""
    file = ConfigFile.from_mapping(config, IN_MEMORY)
    resolved, manager = resolve_config(file, overrides, plugins)
    folder = Path(resolved.trainer.default_local_dir) / DATASETS
    datasets = {"data.train_files": ("train_dataset", train_dataset)}
    if val_dataset is not None:
        datasets["data.val_files"] = ("val_dataset", val_dataset)
    for key, (name, rows) in datasets.items():
        if OmegaConf.select(resolved, key):
            logger.warning("%s names %s; run_ppo trains on its %s instead", key, OmegaConf.select(resolved, key), name)
        path = write_dataset(rows, folder / f"{name.split('_')[0]}.jsonl", name)
        OmegaConf.update(resolved, key, str(path))
    return run_resolved(resolved, manager, show_progress)
