"""The built-in metric sinks pass the shipped sink contract."""

from __future__ import annotations

import json
import math

import pytest

from agl_core.testing.contracts import MetricSinkContract


class TestRunLogContract(MetricSinkContract):
    sink_name = "jsonl"

    @pytest.fixture(autouse=True)
    def _no_plot(self, monkeypatch):
        """The contract checks the records; drawing metrics.png at every close only costs time."""
        monkeypatch.setattr("agl_core.tracking.run_log.plot_metrics", lambda *args, **kwargs: None)

    def read_back(self, context):
        path = context.run_dir / "metrics.jsonl"
        records = []
        for line in path.read_text().splitlines():
            record = json.loads(line)
            step = record.pop("step")
            record.pop("wall_s", None)
            records.append((step, {k: math.nan if v is None else v for k, v in record.items()}))
        return records


class TestConsoleContract(MetricSinkContract):
    sink_name = "console"
