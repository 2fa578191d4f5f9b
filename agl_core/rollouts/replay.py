"""The replay source (``agentlightning.replay: PATH``): recorded steps instead of agents.

Step ``N`` of the run gets the rollouts recorded for step ``N`` (:mod:`agl_core.files.recording`), exactly
as the recording run's pipeline received them: no agent, gateway or generation runs, and the dataset
samples handed to ``collect`` are not used. A recording of another model or
tokenizer is refused before the first step; a step the recording does not hold, and validation
(a recording holds training steps only), are errors naming the file. A step asked for without the
backend having told the source of its weights (``after_weight_update``) since the last one is an
error too: the backend contract's runs replay, so a backend that never tells its source fails them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig

from agl_core.config import ConfigError
from agl_core.errors import UsageError
from agl_core.files.recording import Recording, read_recording
from agl_core.rollouts.source import RolloutBatch, RolloutSource

__all__ = ["ReplayRolloutSource"]


class ReplayRolloutSource(RolloutSource):
    """Feeds the recording at ``agentlightning.replay`` to the run, step by step; ``tokenizer`` is the
    run's, checked against the recording's fingerprint."""

    __module__ = "agl_core"

    def __init__(self, config: DictConfig, tokenizer: Any):
        self.recording: Recording = read_recording(str(config.agentlightning.replay))
        self.recording.check(config, tokenizer)
        self.told = False  # after_weight_update was called since the last step

    def collect(self, samples: Sequence[Mapping[str, Any]], *, step: int, is_train: bool) -> RolloutBatch:
        if not is_train:
            raise ConfigError(
                "agentlightning.replay",
                f"{self.recording.path} holds training steps only: a replayed run cannot validate "
                "(unset data.val_files, or set trainer.val_before_train=false and trainer.test_freq=-1)",
            )
        if not self.told:  # a backend tells its source of the weights each step's rollouts come from
            raise UsageError(
                f"step {step} asked the replay source for rollouts, but the backend did not call "
                "after_weight_update(endpoints, version) with the weights they come from since the last step: "
                "a backend tells its rollout source of the weights it starts from and of every step's new ones"
            )
        self.told = False
        rollouts = self.recording.rollouts(step)
        return RolloutBatch(rollouts, {"training/replay/n_rollouts_replayed": float(len(rollouts))})

    def before_weight_update(self) -> dict[str, float]:
        return {}

    def after_weight_update(self, endpoints: Sequence[str], version: int) -> None:
        self.told = True

    def close(self) -> None:
        pass
