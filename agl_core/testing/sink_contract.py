"""The metric-sink contract: what every sink registered through ``agl_register_metric_sinks`` must do.

Subclass :class:`MetricSinkContract` in a ``test_*.py`` file::

    import my_package
    from agl_core.testing.contracts import MetricSinkContract

    class TestMySink(MetricSinkContract):
        sink_name = "my_sink"
        plugins = (my_package,)

        def read_back(self, context):
            # what the sink recorded under context.run_dir, as [(step, {name: value}), ...]
            ...

Every sink, on generated runs (steps from 0 or from a resumed step on, metrics whose names change
from step to step, values NaN at times, sample tables before some steps):

- takes every call of a run (``log_samples``, ``log_metrics``, ``close``) without an error.

With ``read_back`` (the author's reader of what the sink wrote: the reference it is held to):

- after ``close``, every step was recorded once, in order, with its metrics (``close`` flushes);
- a resumed run (a second sink on the same run directory, starting after the checkpoint step)
  leaves every step once: the first run's up to the checkpoint, the second's after it.
"""

from __future__ import annotations

from agl_core.testing import hypothesis_missing

try:
    from hypothesis import given
    from hypothesis import strategies as st
except ModuleNotFoundError as exc:
    raise hypothesis_missing(__name__) from exc

import math
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from agl_core.testing.lookup import PluginContract
from agl_core.testing.snapshots import shorten
from agl_core.testing.strategies import CONTRACT_SETTINGS
from agl_core.tracking import MetricSink, SinkContext

__all__ = ["MetricSinkContract", "Step", "check_records", "metric_runs", "play"]

Step = tuple[int, Mapping[str, float], Mapping[str, list[dict[str, Any]]]]
"""One step of a run: its number, its metrics, its sample tables (maybe empty)."""

_NAMES = ("training/reward", "val/reward", "actor/pg_loss", "timing/step_s", "training/n_rollouts")
_VALUES = st.one_of(st.floats(-1e6, 1e6, allow_nan=False), st.just(math.nan), st.integers(0, 1000).map(float))


@st.composite
def metric_runs(draw: st.DrawFn, start: int = 0, max_steps: int = 6) -> list[Step]:
    """Consecutive steps from ``start`` (0: a validation before training; later: a resumed run,
    whose steps may cross from one digit to two), each with 1-5 metrics (not always the same names)
    and sometimes a sample table."""
    steps = []
    for step in range(start, start + draw(st.integers(1, max_steps))):
        names = draw(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=len(_NAMES), unique=True))
        metrics = {name: draw(_VALUES) for name in names}
        samples = (
            {"trajectories": [{"step": step, "rollout_id": f"r{step}", "reward": 1.0}]} if draw(st.booleans()) else {}
        )
        steps.append((step, metrics, samples))
    return steps


def play(sink: MetricSink, steps: Sequence[Step]) -> None:
    """Give ``sink`` the steps as ``agl train`` does (samples first, then metrics), then close it."""
    try:
        for step, metrics, samples in steps:
            if samples:
                sink.log_samples(step, samples)
            sink.log_metrics(step, metrics)
    finally:
        sink.close()


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def check_records(records: Sequence[tuple[int, Mapping[str, float]]], expected: Sequence[Step], what: str) -> None:
    """``records`` (as read back) are the ``expected`` steps' metrics, each step once, in order."""
    got_steps = [int(step) for step, _ in records]
    want_steps = [step for step, _, _ in expected]
    if got_steps != want_steps:
        duplicated = sorted({s for s in got_steps if got_steps.count(s) > 1})
        missing = sorted(set(want_steps) - set(got_steps))
        raise AssertionError(
            f"{what}: the sink recorded steps {shorten(got_steps, 200)}, "
            f"expected {shorten(want_steps, 200)} (every step once, in "
            f"order)"
            + (f"; duplicated: {duplicated}" if duplicated else "")
            + (f"; missing: {missing}" if missing else "")
        )
    for (step, got), (_, want, _) in zip(records, expected):
        for name, value in want.items():
            if name not in got or not _same(float(got[name]), float(value)):
                raise AssertionError(
                    f"{what}: step {step} metric {name!r} was logged as {value!r}, the sink recorded "
                    f"{got.get(name, 'nothing')!r} (all of the step: {shorten(dict(got), 200)})"
                )


class MetricSinkContract(PluginContract):
    """Base test class: subclass it, set ``sink_name`` (and ``plugins``), and pytest runs the contract."""

    registry, name_attribute = "metric_sinks", "sink_name"
    sink_name: ClassVar[str] = ""

    def read_back(self, context: SinkContext) -> list[tuple[int, Mapping[str, float]]] | None:
        """What the sink recorded under ``context.run_dir``, in order: ``[(step, metrics), ...]``.
        Override it; ``None`` (the default) skips the properties that need it."""
        return None

    def open(self, run_dir: Path) -> tuple[MetricSink, SinkContext]:
        context = SinkContext(run_dir=run_dir, project_name="contract", experiment_name="run", config={"trainer": {}})
        return self.plugin_under_test()(context), context

    @given(steps=metric_runs())
    @CONTRACT_SETTINGS
    def test_takes_every_call_of_a_run(self, steps):
        with tempfile.TemporaryDirectory() as folder:
            sink, _ = self.open(Path(folder))
            play(sink, steps)

    @given(steps=st.sampled_from([0, 1, 7]).flatmap(metric_runs))
    @CONTRACT_SETTINGS
    def test_every_step_once_in_order_flushed_by_close(self, steps):
        with tempfile.TemporaryDirectory() as folder:
            sink, context = self.open(Path(folder))
            play(sink, steps)
            records = self.read_back(context)
            if records is None:
                pytest.skip("no read_back given: what the sink records cannot be checked")
            check_records(records, steps, "one run")

    @given(data=st.data())
    @CONTRACT_SETTINGS
    def test_a_resumed_run_records_each_step_once(self, data):
        first = data.draw(metric_runs(start=1), "first run")
        checkpoint = data.draw(st.integers(first[0][0] - 1, first[-1][0]), "checkpoint step")
        second = data.draw(metric_runs(start=checkpoint + 1), "resumed run")
        with tempfile.TemporaryDirectory() as folder:
            sink, context = self.open(Path(folder))
            play(sink, first)
            sink, _ = self.open(Path(folder))
            play(sink, second)
            records = self.read_back(context)
            if records is None:
                pytest.skip("no read_back given: what the sink records cannot be checked")
            kept = [step for step in first if step[0] <= checkpoint]
            check_records(records, kept + second, f"a run resumed after step {checkpoint}")
