"""What a metric sink is, and how a run's sinks are chosen (``trainer.logger``) and opened."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from agl_core.config import ConfigError, redacted
from agl_core.data import StepSamples

__all__ = ["ALWAYS_ON", "MetricSink", "SinkContext", "SinkFactory", "open_sinks", "sink_names", "table_columns"]

ALWAYS_ON = "jsonl"
"""The run log (``metrics.jsonl``, ``samples/*.jsonl``, ``metrics.png``): resuming a run and ``agl
plot`` read it, so every run writes it, whatever ``trainer.logger`` lists."""


@attrs.frozen
class SinkContext:
    """What a sink factory is given: the run directory (``trainer.default_local_dir``), verl's
    ``trainer.project_name`` / ``trainer.experiment_name``, and the run config as plain data with
    the gateway key redacted (for trackers that record it)."""

    run_dir: Path
    project_name: str = "agl"
    experiment_name: str = "run"
    config: Mapping[str, Any] = attrs.field(factory=dict)


class MetricSink(Protocol):
    """One destination of a run's metrics. The first step a sink is given is where this run starts:
    a resumed run redoes the steps after its checkpoint, so a sink that keeps a log in the run
    directory drops what an earlier run logged from that step on."""

    __module__ = "agl_core"

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record a step's metrics (name → float; may be NaN)."""

    def log_samples(self, step: int, samples: StepSamples) -> None:
        """Record a step's sample tables (name → rows of JSON-like dicts); called before
        :meth:`log_metrics` of the same step, and only with non-empty tables."""

    def close(self) -> None:
        """Flush and release; called once when the run ends, also after an error."""


SinkFactory = Callable[[SinkContext], MetricSink]
"""``factory(context)``: what ``agl_register_metric_sinks`` registers."""


def sink_names(config: Any) -> list[str]:
    """``ALWAYS_ON``, then ``trainer.logger`` in order (a name, or a list of names, as verl takes
    it), each once."""
    logger = config.trainer.logger
    listed = [logger] if isinstance(logger, str) else list(logger or [])
    for name in listed:
        if not isinstance(name, str) or not name:
            raise ConfigError("trainer.logger", f"must list metric sink names, got {name!r}")
    return list(dict.fromkeys([ALWAYS_ON, *listed]))


def open_sinks(factories: Sequence[tuple[str, SinkFactory]], config: Any) -> list[MetricSink]:
    """Build the sinks of ``factories`` (``(name, factory)``, as looked up by :func:`sink_names`)
    for the run ``config``; the ones already open are closed when one fails. A sink that cannot
    start is a :class:`~agl_core.config.ConfigError` of ``trainer.logger`` naming the sink."""
    from omegaconf import OmegaConf

    trainer = config.trainer
    context = SinkContext(
        run_dir=Path(trainer.default_local_dir),
        project_name=str(trainer.project_name),
        experiment_name=str(trainer.experiment_name),
        config=OmegaConf.to_container(redacted(config), resolve=True),
    )
    context.run_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[MetricSink] = []
    try:
        for name, factory in factories:
            try:
                sinks.append(factory(context))
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError("trainer.logger", f"metric sink {name!r} could not start: {error_gist(exc)}") from exc
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


def error_gist(exc: BaseException) -> str:
    """``Type: first line of the message``: a tracker's error, on the one line an ``agl: error`` has."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def table_columns(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """A table's columns (in first-seen order) and its rows as lists, for trackers with tables:
    numbers, strings, booleans and ``None`` stay as they are, anything else becomes JSON text."""
    columns = list(dict.fromkeys(key for row in rows for key in row))

    def cell(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return json.dumps(value, ensure_ascii=False)

    return columns, [[cell(row.get(column)) for column in columns] for row in rows]
