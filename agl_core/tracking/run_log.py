"""The run log (metric sink ``jsonl``, always on): JSON lines in the run directory, and the plot.

``metrics.jsonl`` gets one object per step (``step``, then the metrics; a non-finite value is written
as ``null``), ``samples/<table>.jsonl`` one object per sample row (``samples/trajectories.jsonl``,
``samples/mismatches.jsonl``; each row has its ``step``), and ``metrics.png`` is drawn every
:data:`PLOT_EVERY` steps and when the run ends. A run that resumes a directory starts by dropping
the lines of the steps it redoes (those an earlier run logged after its last checkpoint).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agl_core.data import StepSamples
from agl_core.errors import UsageTypeError
from agl_core.files.jsonl import read_json_objects
from agl_core.tracking.plot import plot_metrics
from agl_core.tracking.sink import SinkContext

__all__ = ["METRICS_FILE", "PLOT_EVERY", "PLOT_FILE", "SAMPLES_DIR", "RunLog", "forget_from"]

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
SAMPLES_DIR = "samples"
PLOT_EVERY = 25


class RunLog:
    def __init__(self, context: SinkContext):
        self.run_dir = context.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.plot_path = self.run_dir / PLOT_FILE
        self.samples_dir = self.run_dir / SAMPLES_DIR
        self._started = False

    def _start(self, step: int) -> None:
        if not self._started:
            for path in [self.path, *sorted(self.samples_dir.glob("*.jsonl"))]:
                forget_from(path, step)
            self._started = True

    def log_samples(self, step: int, samples: StepSamples) -> None:
        self._start(step)
        self.samples_dir.mkdir(parents=True, exist_ok=True)
        for name, rows in samples.items():
            with (self.samples_dir / f"{name}.jsonl").open("a", encoding="utf-8") as f:
                f.writelines(_line(row) for row in rows)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._start(step)
        record = {"step": step, **{name: _json_number(value) for name, value in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(_line(record))
        if step % PLOT_EVERY == 0:
            plot_metrics(self.path, self.plot_path)

    def close(self) -> None:
        if self.path.is_file() and self.path.stat().st_size:
            plot_metrics(self.path, self.plot_path)


def forget_from(path: Path, step: int) -> None:
    """Drop the lines of steps >= ``step`` from the JSON-lines file ``path`` (if there is one), left
    by an earlier run of this directory that was killed after logging them but before checkpointing
    them: this run redoes those steps."""
    if not path.is_file():
        return
    records = [record for _, record in read_json_objects(path)]
    kept = [record for record in records if record["step"] < step]
    if len(kept) != len(records):
        path.write_text("".join(_line(record) for record in kept), encoding="utf-8")


def _line(record: Mapping[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, default=_plain) + "\n"


def _plain(value: Any) -> Any:
    """numpy scalars and arrays as Python numbers and lists."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise UsageTypeError(f"a metric or sample value of type {type(value).__name__} is not JSON serializable")


def _json_number(value: Any) -> Any:
    value = float(value)
    return value if math.isfinite(value) else None
