"""Metric sink ``console``: one line per step on standard output, as verl's console logger prints it
(``step:N - name:value - ...``, names sorted). Sample tables are left to the files and trackers."""

from __future__ import annotations

import sys
from collections.abc import Mapping

from agl_core.data import StepSamples
from agl_core.tracking.sink import SinkContext

__all__ = ["Console"]


class Console:
    def __init__(self, context: SinkContext):
        pass

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from tqdm import tqdm

        line = " - ".join([f"step:{step}", *(f"{name}:{float(value):.6g}" for name, value in sorted(metrics.items()))])
        tqdm.write(line, file=sys.stdout)  # above the progress bar, if one is shown

    def log_samples(self, step: int, samples: StepSamples) -> None:
        pass

    def close(self) -> None:
        pass
