"""verl's other trackers as metric sinks, so a verl config's ``trainer.logger`` keeps working.

Every name verl's ``Tracking`` supports that agl has no sink of its own for (``mlflow``,
``swanlab``, ``clearml``, ``trackio``, ``file``...) is registered as a sink that runs verl's
``Tracking`` for that one tracker in the ``agl train`` process, with the run config redacted and
verl's environment variables (``MLFLOW_TRACKING_URI``, ``VERL_FILE_LOGGER_PATH``...). They get the
metrics; the sample tables go to agl's own sinks and files only.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from agl_core import Register, StepSamples

if TYPE_CHECKING:
    from agl_core import SinkContext

__all__ = ["VERL_TRACKERS", "VerlTracker", "register_verl_trackers"]

# verl 0.9.1's ``Tracking.supported_backend``, less the names agl's own sinks serve (console,
# tensorboard, wandb). Listed here so that registering them does not import verl.
VERL_TRACKERS = ("mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio", "file", "rl_insight")


class VerlTracker:
    def __init__(self, name: str, context: SinkContext):
        from verl.utils.tracking import Tracking

        self.tracking: Any = Tracking(
            project_name=context.project_name,
            experiment_name=context.experiment_name,
            default_backend=[name],
            config=dict(context.config),
        )

    def log_samples(self, step: int, samples: StepSamples) -> None:
        pass

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.tracking.log(data=dict(metrics), step=step)

    def close(self) -> None:
        self.tracking.finish()


def register_verl_trackers(register: Register) -> None:
    for name in VERL_TRACKERS:
        register(name, partial(VerlTracker, name))
