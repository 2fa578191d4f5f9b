"""agl's dataset rows in verl's dataset slot (``data.custom_cls``): each row is a rollout group's ``input``.

verl's trainer builds its train and validation datasets with ``create_rl_dataset``, which
instantiates ``data.custom_cls`` when it is set; the verl backend sets it to :class:`TaskDataset`
(:data:`DATASET_SLOT`). The rows are read as every backend reads them (:func:`agl_core.load_dataset`:
JSON lines or parquet, one file or a list) and handed out untouched under ``raw_prompt``, the key
verl's trainer counts a batch's prompts by. Nothing is tokenised: the agents build their own prompts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import ListConfig, OmegaConf
from torch.utils.data import Dataset

from agl_core import ConfigError, load_dataset

__all__ = ["DATASET_SLOT", "INPUT_KEY", "TaskDataset"]

INPUT_KEY = "raw_prompt"
"""The dataset item key holding the row."""

DATASET_SLOT = {"path": "pkg://agl_backend_verl.dataset", "name": "TaskDataset"}
"""``data.custom_cls`` naming :class:`TaskDataset`."""


class TaskDataset(Dataset):
    """The rows of ``data_files``, each item ``{"raw_prompt": row}``; ``max_samples`` >= 0 keeps the
    first that many, as verl's own datasets do. verl passes ``tokenizer`` and ``processor``; rows
    need neither."""

    def __init__(
        self, data_files: Any, tokenizer: Any = None, processor: Any = None, config: Any = None, max_samples: int = -1
    ):
        files = OmegaConf.to_container(data_files) if isinstance(data_files, ListConfig) else data_files
        self.key = (
            "data.val_files" if config is not None and files == _files(config, "val_files") else "data.train_files"
        )
        self.rows = load_dataset(files, self.key)
        self.size = len(self.rows) if max_samples is None or max_samples < 0 else min(max_samples, len(self.rows))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.rows[index]
        if not isinstance(row, Mapping):
            raise ConfigError(self.key, f"row {index} is not an object: {row!r:.80}")
        return {INPUT_KEY: dict(row)}


def _files(config: Any, key: str) -> Any:
    value = config.get(key)
    return OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
