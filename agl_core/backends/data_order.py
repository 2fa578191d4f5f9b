"""The order in which the step loop reads its training rows, reproducible across restarts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from agl_core.config import ConfigError
from agl_core.files.datasets import load_dataset

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["DataOrder"]


class DataOrder:
    """The training rows in epoch order: reshuffled per epoch from ``(seed, epoch)``, so a position
    ``(epoch, index)`` names the same rows in every run; an incomplete last batch is skipped."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], batch_size: int, shuffle: bool, seed: int):
        if len(rows) < batch_size:
            raise ConfigError("data.train_batch_size", f"is {batch_size}, but the dataset has only {len(rows)} rows")
        self.rows, self.batch_size, self.shuffle, self.seed = rows, batch_size, shuffle, seed
        self.steps_per_epoch = len(rows) // batch_size
        self.epoch, self.index = 0, 0

    @classmethod
    def from_config(cls, config: DictConfig) -> DataOrder:
        """``data.train_files`` in batches of ``data.train_batch_size``, shuffled by ``data.shuffle``
        with ``data.seed`` (``trainer.seed`` when unset)."""
        data = config.data
        seed = data.seed if data.seed is not None else config.trainer.seed
        return cls(load_dataset(data.train_files), int(data.train_batch_size), bool(data.shuffle), int(seed))

    def next_batch(self) -> list[Mapping[str, Any]]:
        if self.index >= self.steps_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        order = (
            np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))
            if self.shuffle
            else np.arange(len(self.rows))
        )
        picked = order[self.index * self.batch_size : (self.index + 1) * self.batch_size]
        self.index += 1
        return [self.rows[i] for i in picked]

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, position: Mapping[str, int]) -> None:
        self.epoch, self.index = int(position["epoch"]), int(position["index"])
