"""The run driver behind ``agl train``: config → plugin manager → the configured backend's ``fit``.

While the backend trains, each step's metrics and sample tables go to the run's metric sinks
(:mod:`agl_core.tracking`): the run log in the run directory (``trainer.default_local_dir``:
``metrics.jsonl`` with the step number and the wall time since the run started, ``samples/*.jsonl``,
``metrics.png``), then those ``trainer.logger`` names (``console``, ``tensorboard``, ``wandb``, a
plugin's). A validation before the first step is logged as step 0. A progress bar shows step,
reward, validation reward and throughput.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_core.backends.contract import BackendSpec, backend_spec
from agl_core.config import ConfigFile
from agl_core.data import StepSamples
from agl_core.datasets import check_datasets
from agl_core.plugins import PluginManager
from agl_core.tracking import MetricSink, SinkContext, open_sinks, sink_names
from agl_core.tracking.run_log import METRICS_FILE, PLOT_FILE, RunLog

__all__ = [
    "METRICS_FILE",
    "PLOT_FILE",
    "MetricsLog",
    "preflight",
    "replay_step",
    "resolve_config",
    "run",
    "run_resolved",
]

logger = logging.getLogger(__name__)


class MetricsLog:
    """``agl train``'s ``on_step``: hands every step to the sinks (by default only the run log of
    ``run_dir``) and keeps the progress bar up to date.

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
    ):
        from tqdm import tqdm

        self.sinks = list(sinks) if sinks is not None else [] if opener is not None else [RunLog(SinkContext(run_dir))]
        self._opener = opener
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
    """Train as the config says; return the run directory (metrics, samples, plot, checkpoints)."""
    config, manager = resolve_config(config_path, overrides, plugins)
    return run_resolved(config, manager, show_progress)


def run_resolved(config: Any, manager: PluginManager, show_progress: bool = True) -> Path:
    """:func:`run` of a config :func:`resolve_config` returned, with its plugin manager.

    The sinks are looked up before the backend is built (an unknown name in ``trainer.logger`` is an
    error naming the key and the registered sinks) and opened when the backend reports its first
    step, after its own checks."""
    _, factories = preflight(config, manager)
    backend = _spec(manager, config.agentlightning.backend).factory(config, manager)
    log = MetricsLog(
        Path(config.trainer.default_local_dir), show_progress, opener=lambda: open_sinks(factories, config)
    )
    try:
        backend.fit(log)
    finally:
        log.close()
    return Path(config.trainer.default_local_dir)


def preflight(config: Any, manager: PluginManager) -> tuple[dict[str, int], list[tuple[str, Any]]]:
    """What ``agl train`` checks before it builds the backend, and ``agl check`` with it: the plugins
    the config names, the dataset
    files (every row holds the ``agentlightning.local.env_map`` fields, unless an ``agl_on_enqueue``
    hook may add them when it rewrites a request) and the metric sinks ``trainer.logger`` names.
    The aggregator, estimator and loss the config selects are looked up first (an unknown name is an
    error naming its key). Returns the rows per dataset key and the sinks' ``(name, factory)``."""
    for registry, name in (
        (manager.aggregators, config.agentlightning.trace_aggregator.level),
        (manager.advantage_estimators, config.algorithm.adv_estimator),
        (manager.policy_losses, config.actor_rollout_ref.actor.policy_loss.loss_mode),
    ):
        registry.entry(name)
    counts = {}
    rewriters = manager.implementations("agl_on_enqueue")
    if config.data.train_files:  # a backend that reads no dataset files has none to check
        counts = check_datasets(config, check_env_map=not rewriters)
        if rewriters and config.agentlightning.local.env_map:
            logger.warning(
                "agentlightning.local.env_map is not checked against the dataset rows: agl_on_enqueue of %s may "
                "rewrite them (agl check says so too)",
                ", ".join(rewriters),
            )
    return counts, [(name, manager.metric_sinks.get(name)) for name in sink_names(config)]


def replay_step(
    run: str | Path, step: int, overrides: Sequence[str] = (), scratch: str | Path = ".", plugins: Iterable[Any] = ()
) -> dict[str, float]:
    """Re-run step ``step`` of the run recorded at ``run`` (``agl replay``): its recorded rollouts
    through the pipeline and the torch backend's update, from the run's checkpoint of the step before
    when its directory holds one, else the initial model; return the step's metrics.

    The config is the recording's (the keys the core schema knows), then ``overrides``; the dataset is
    the step's recorded samples, written to ``scratch``. A recording of another model or tokenizer
    than the config's is refused (:class:`~agl_core.recording.RecordingError`)."""
    import json

    from omegaconf import OmegaConf

    from agl_core.fields import thaw
    from agl_core.recording import read_recording

    recording = read_recording(run)
    rollouts = recording.rollouts(step)
    scratch = Path(scratch)
    config_file, dataset = scratch / "config.yaml", scratch / "samples.jsonl"
    OmegaConf.save(OmegaConf.create(recording.core_config()), config_file)
    rows = [s if isinstance(s, Mapping) else {} for s in {r.group_id: thaw(r.input) for r in rollouts}.values()] or [{}]
    while len(rows) < int(recording.core_config().get("data", {}).get("train_batch_size") or 1):
        rows += rows  # the torch backend's data order needs a whole batch; replay reads none of it
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    replayed = [
        f"agentlightning.replay={recording.path}",
        "agentlightning.record_rollouts=false",
        "agentlightning.agl_base_url=null",
        "agentlightning.async_rollout.enabled=false",
        "agentlightning.backend=torch",
        f"data.train_files={dataset}",
        "data.val_files=null",
        f"trainer.default_local_dir={recording.path.parent}",
    ]
    config, manager = resolve_config(str(config_file), [*replayed, *overrides], plugins)
    backend = _spec(manager, "torch").factory(config, manager)
    recording.check(config, backend.tokenizer)
    return backend.replay_step(rollouts, step)


def resolve_config(
    config_path: str | ConfigFile | None, overrides: Sequence[str] = (), plugins: Iterable[Any] = ()
) -> tuple[Any, PluginManager]:
    """The run's validated config and its plugin manager.

    The file is read once (:class:`~agl_core.config.ConfigFile`; one already made is taken as it is).
    The backend is read first (``agentlightning.backend`` from the overrides, else the YAML, else the
    schema's default), so that the run is validated by that backend's ``load_config``
    (:class:`~agl_core.backends.contract.BackendSpec`) (verl: verl's full config; by default the core
    schema's :func:`~agl_core.config.load_config`).
    """
    from omegaconf import OmegaConf

    from agl_core.config import ConfigError, default_config, read_config_file, with_backend_hint

    source = (
        config_path if config_path is None or isinstance(config_path, ConfigFile) else read_config_file(config_path)
    )
    raw = _unvalidated(source, overrides)
    hooks = OmegaConf.select(raw, "agentlightning.hooks", default=None, throw_on_resolution_failure=False)
    if not isinstance(hooks, str) and not (OmegaConf.is_list(hooks) and all(isinstance(h, str) for h in hooks)):
        hooks = None  # malformed: validation names the key
    manager = PluginManager.from_config({"agentlightning": {"hooks": hooks}}, plugins)
    manager.refuse_broken()
    name = OmegaConf.select(raw, "agentlightning.backend", default=None, throw_on_resolution_failure=False)
    name = default_config().agentlightning.backend if name is None else name
    try:
        config = _spec(manager, name).load_config(source, overrides)
    except ConfigError as exc:  # an unknown key may be one of another backend's: say which
        others = {e.name: backend_spec(e).load_config for e in manager.backends.entries() if e.name != name}
        raise with_backend_hint(exc, source, overrides, others) from None
    manager.hook_timeout_seconds = float(config.agentlightning.hook_timeout_seconds)
    manager.configure(config)  # the plugins' settings (agentlightning.plugins), validated
    return config, manager


def _spec(manager: PluginManager, name: str) -> BackendSpec:
    return backend_spec(manager.backends.entry(name))


def _unvalidated(source: ConfigFile | None, overrides: Sequence[str]) -> Any:
    """The file's content with the overrides merged over it, unchecked; empty when the overrides
    cannot be read (the loader then reports why, naming the key)."""
    from omegaconf import OmegaConf

    try:
        user = source.content if source is not None else {}
        return OmegaConf.merge(user, OmegaConf.from_dotlist([o for o in overrides if "=" in o]))
    except Exception:
        return OmegaConf.create()
