"""The built-in metric sinks (plugin ``sinks``): ``jsonl`` (the run log, always on), ``console``,
``tensorboard`` and ``wandb``. Each imports its tracker only when a run opens it."""

from __future__ import annotations

from agl_core.hookspecs import Register, hookimpl
from agl_core.tracking.console import Console
from agl_core.tracking.run_log import RunLog
from agl_core.tracking.tensorboard_sink import TensorBoard
from agl_core.tracking.wandb_sink import WandB

__all__ = ["agl_register_metric_sinks"]


@hookimpl
def agl_register_metric_sinks(register: Register) -> None:
    register("jsonl", RunLog)
    register("console", Console)
    register("tensorboard", TensorBoard)
    register("wandb", WandB)
