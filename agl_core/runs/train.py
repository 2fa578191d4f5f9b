"""The run driver behind ``agl train``: config → plugin manager → the configured backend's ``fit``.

While the backend trains, each step's metrics and sample tables go to the run's metric sinks
(:mod:`agl_core.tracking`): the run log in the run directory (``trainer.default_local_dir``:
``metrics.jsonl`` with the step number and the wall time since the run started, ``samples/*.jsonl``,
``metrics.png``), then those ``trainer.logger`` names (``console``, ``tensorboard``, ``wandb``, a
plugin's). A validation before the first step is logged as step 0. A progress bar shows step,
reward, validation reward and throughput.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_core.backends.untrained import UntrainedSteps
from agl_core.config import ConfigFile
from agl_core.data import StepSamples
from agl_core.plugins import PluginManager
from agl_core.runs.preflight import preflight
from agl_core.runs.run_config import registered_backend, resolve_config
from agl_core.tracking import MetricSink, SinkContext, open_sinks
from agl_core.tracking.run_log import RunLog

__all__ = ["MetricsLog", "run", "run_resolved"]


class MetricsLog:
    """``agl train``'s ``on_step``: hands every step to the sinks (by default only the run log of
    ``run_dir``) and keeps the progress bar up to date.

    ``max_untrained_steps`` steps in a row that trained nothing stop the run
    (:mod:`agl_core.backends.untrained`; 0: never).

    ``opener``, if given, opens the sinks when the first step arrives: by then the backend has passed
    its own preflight checks (verl's GPU check runs inside ``fit``), so a tracker that cannot start
    (W&B without a login) is not reported before what the backend would have refused."""

    def __init__(
        self,
        run_dir: Path,
        show_progress: bool = True,
        sinks: Sequence[MetricSink] | None = None,
        *,
        opener: Callable[[], Sequence[MetricSink]] | None = None,
        max_untrained_steps: int = 0,
    ):
        from tqdm import tqdm

        self.sinks = list(sinks) if sinks is not None else [] if opener is not None else [RunLog(SinkContext(run_dir))]
        self._opener = opener
        self.untrained = UntrainedSteps(max_untrained_steps)
        self.started = time.monotonic()
        self.bar = tqdm(desc="agl train", unit="step", disable=not show_progress, dynamic_ncols=True)

    def __call__(
        self, step: int, total_steps: int, metrics: Mapping[str, float], samples: StepSamples | None = None
    ) -> None:
        if self._opener is not None:
            opener, self._opener = self._opener, None
            self.sinks.extend(opener())
        logged = {"wall_s": round(time.monotonic() - self.started, 3), **metrics}
        tables = {name: rows for name, rows in (samples or {}).items() if rows}
        for sink in self.sinks:
            if tables:
                sink.log_samples(step, tables)
            sink.log_metrics(step, logged)
        self._progress(step, total_steps, metrics)
        self.untrained.observe(step, metrics)  # after logging: the step that stops the run is on record

    def _progress(self, step: int, total_steps: int, metrics: Mapping[str, float]) -> None:
        if self.bar.total != total_steps:
            self.bar.total = total_steps
        if self.bar.n == 0 and step > 1:
            self.bar.update(step - 1)  # a resumed run starts part-way
        if step > 0:
            self.bar.update(1)
        postfix = {"reward": f"{metrics.get('training/reward', float('nan')):.3f}"}
        if "val/reward" in metrics:
            postfix["val"] = f"{metrics['val/reward']:.3f}"
        step_s = metrics.get("timing/step_s")
        if step_s:
            postfix["rollouts/s"] = f"{metrics.get('training/n_rollouts', 0.0) / step_s:.1f}"
        self.bar.set_postfix(postfix)

    def close(self) -> None:
        """Close the bar and every sink (all of them, even when one fails; the first error is raised)."""
        self.bar.close()
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


def run(
    config_path: str | ConfigFile | None,
    overrides: Sequence[str] = (),
    plugins: Iterable[Any] = (),
    show_progress: bool = True,
) -> Path:
    """Train as the config says; return the run directory (metrics, samples, plot, checkpoints).

    The config is resolved (:func:`~agl_core.runs.run_config.resolve_config`) and checked
    (:func:`~agl_core.runs.preflight.preflight`: an unknown name in ``trainer.logger`` is an error naming
    the key and the registered sinks) before the backend is built; the sinks are opened when the
    backend reports its first step, after its own checks."""
    config, manager = resolve_config(config_path, overrides, plugins)
    return run_resolved(config, manager, show_progress)


def run_resolved(config: Any, manager: PluginManager, show_progress: bool = True) -> Path:
    """:func:`run` of a config :func:`~agl_core.runs.run_config.resolve_config` returned, with its plugin manager."""
    checked = preflight(config, manager)
    backend = registered_backend(manager, config.agentlightning.backend).factory(config, manager)
    log = MetricsLog(
        Path(config.trainer.default_local_dir),
        show_progress,
        opener=lambda: open_sinks(checked.sinks, config),
        max_untrained_steps=int(config.agentlightning.max_untrained_steps),
    )
    try:
        backend.fit(log)
    finally:
        log.close()
    log.untrained.check_end()
    return Path(config.trainer.default_local_dir)
