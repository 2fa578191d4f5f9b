"""Metric sink ``tensorboard``: TensorBoard event files in ``<run dir>/tensorboard``.

Every metric is a scalar under its own name; every sample table is a text entry
``samples/<table>`` holding a Markdown table. Events are flushed after each step. A resumed run
purges the events of the steps it redoes (``SummaryWriter``'s ``purge_step``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agl_core.config import ConfigError
from agl_core.data import StepSamples
from agl_core.tracking.sink import SinkContext, table_columns

__all__ = ["LOG_DIR", "TensorBoard", "markdown_table"]

LOG_DIR = "tensorboard"


class TensorBoard:
    def __init__(self, context: SinkContext):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                "trainer.logger", f"metric sink 'tensorboard' needs the tensorboard package ({exc})"
            ) from exc
        self._writer_class = SummaryWriter
        self.log_dir = context.run_dir / LOG_DIR
        self.writer: Any = None

    def _writer(self, step: int) -> Any:
        if self.writer is None:
            self.writer = self._writer_class(log_dir=str(self.log_dir), purge_step=step)
        return self.writer

    def log_samples(self, step: int, samples: StepSamples) -> None:
        writer = self._writer(step)
        for name, rows in samples.items():
            writer.add_text(f"samples/{name}", markdown_table(rows), step)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        writer = self._writer(step)
        for name, value in metrics.items():
            writer.add_scalar(name, float(value), step)
        writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def markdown_table(rows: list[Mapping[str, Any]] | Any) -> str:
    """``rows`` as a Markdown table (TensorBoard renders text entries as Markdown)."""
    columns, values = table_columns(rows)

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines.extend("| " + " | ".join(cell(v) for v in row) + " |" for row in values)
    return "\n".join(lines)
