"""Metric sinks: where ``agl train`` sends every step's metrics and sample tables, on every backend.

The sinks of a run are named by ``trainer.logger`` (verl's key, e.g. ``[console, tensorboard,
wandb]``) and registered by plugins through ``agl_register_metric_sinks``; the built-ins are in
``agl_core.builtins.sinks``. They run in the ``agl train`` process: a backend hands each step's
metrics and samples to ``on_step`` (the verl backend streams them there from its Ray actor).

May import only the base modules (``data``, ``config``, the helpers).
"""

from agl_core.tracking.sink import (
    ALWAYS_ON,
    MetricSink,
    SinkContext,
    SinkFactory,
    open_sinks,
    sink_names,
    table_columns,
)

__all__ = ["ALWAYS_ON", "MetricSink", "SinkContext", "SinkFactory", "open_sinks", "sink_names", "table_columns"]
