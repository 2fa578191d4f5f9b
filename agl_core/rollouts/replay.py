"""The replay source (``agentlightning.replay: PATH``): recorded steps instead of agents.

Step ``N`` of the run gets the rollouts recorded for step ``N`` (:mod:`agl_core.recording`), exactly
as the recording run's pipeline received them: no agent, gateway or generation runs, and the dataset
samples handed to ``collect`` are not used. A recording of another model or
tokenizer is refused before the first step; a step the recording does not hold, and validation
(a recording holds training steps only), are errors naming the file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig

from agl_core.config import ConfigError
from agl_core.recording import Recording, read_recording
from agl_core.rollouts.source import RolloutBatch, RolloutSource

__all__ = ["ReplayRolloutSource"]


class ReplayRolloutSource(RolloutSource):
    """Feeds the recording at ``agentlightning.replay`` to the run, step by step; ``tokenizer`` is the
    run's, checked against the recording's fingerprint."""

    __module__ = "agl_core"

    def __init__(self, config: DictConfig, tokenizer: Any):
        self.recording: Recording = read_recording(str(config.agentlightning.replay))
        self.recording.check(config, tokenizer)

    def collect(self, samples: Sequence[Mapping[str, Any]], *, step: int, is_train: bool) -> RolloutBatch:
        if not is_train:
            raise ConfigError(
                "agentlightning.replay",
                f"{self.recording.path} holds training steps only: a replayed run cannot validate "
                "(unset data.val_files, or set trainer.val_before_train=false and trainer.test_freq=-1)",
            )
        rollouts = self.recording.rollouts(step)
        return RolloutBatch(rollouts, {"training/replay/n_rollouts_replayed": float(len(rollouts))})

    def before_weight_update(self) -> dict[str, float]:
        return {}

    def after_weight_update(self, endpoints: Sequence[str], version: int) -> None:
        pass

    def close(self) -> None:
        pass
