"""The run driver behind ``agl train``: config → plugin manager → the configured backend's ``fit``.

While the backend trains, each step's metrics are appended to ``metrics.jsonl`` in the run directory
(``trainer.default_local_dir``) with the step number and the wall time since the run started (a
validation before the first step is logged as step 0), a progress bar shows step, reward,
validation reward and throughput, and ``metrics.png`` is drawn at the end (also after
an error, for the steps done) and every ``PLOT_EVERY`` steps.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_core.backends.contract import BackendSpec, backend_spec
from agl_core.jsonl import read_json_objects
from agl_core.plot import plot_metrics
from agl_core.plugins import PluginManager

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
PLOT_EVERY = 25


class MetricsLog:
    """Appends one JSON line per step and keeps the progress bar up to date."""

    def __init__(self, run_dir: Path, show_progress: bool = True):
        from tqdm import tqdm

        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / METRICS_FILE
        self.plot_path = run_dir / PLOT_FILE
        self.started = time.monotonic()
        self._logged = False
        self.bar = tqdm(desc="agl train", unit="step", disable=not show_progress, dynamic_ncols=True)

    def __call__(self, step: int, total_steps: int, metrics: Mapping[str, float]) -> None:
        if not self._logged:
            self._forget_from(step)
            self._logged = True
        record = {"step": step, "wall_s": round(time.monotonic() - self.started, 3)}
        record.update({k: _json_number(v) for k, v in metrics.items()})
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
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
        if step % PLOT_EVERY == 0:
            plot_metrics(self.path, self.plot_path)

    def _forget_from(self, step: int) -> None:
        """Drop lines of steps >= ``step`` left by an earlier run of this directory that was killed
        after logging them but before checkpointing them: this run redoes those steps."""
        if not self.path.is_file():
            return
        records = [record for _, record in read_json_objects(self.path)]
        kept = [record for record in records if record["step"] < step]
        if len(kept) != len(records):
            self.path.write_text("".join(json.dumps(record) + "\n" for record in kept), encoding="utf-8")

    def close(self) -> None:
        self.bar.close()
        if self.path.is_file() and self.path.stat().st_size:
            plot_metrics(self.path, self.plot_path)


def _json_number(value: Any) -> Any:
    value = float(value)
    return value if math.isfinite(value) else None


def run(
    config_path: str | None, overrides: Sequence[str] = (), plugins: Iterable[Any] = (), show_progress: bool = True
) -> Path:
    """Train as the config says; return the run directory (metrics, plot, checkpoints)."""
    config, manager = resolve_config(config_path, overrides, plugins)
    backend = _spec(manager, config.agentlightning.backend).factory(config, manager)
    log = MetricsLog(Path(config.trainer.default_local_dir), show_progress)
    try:
        backend.fit(log)
    finally:
        log.close()
    return Path(config.trainer.default_local_dir)


def resolve_config(
    config_path: str | None, overrides: Sequence[str] = (), plugins: Iterable[Any] = ()
) -> tuple[Any, PluginManager]:
    """The run's validated config and its plugin manager.

    The backend is read first (``agentlightning.backend`` from the overrides, else the YAML, else the
    schema's default), so that the run is validated by that backend's
    :attr:`~agl_core.backends.contract.BackendSpec.load_config` (verl: verl's full config; by default
    the core schema's :func:`~agl_core.config.load_config`).
    """
    from omegaconf import OmegaConf

    from agl_core.config import default_config

    raw = _unvalidated(config_path, overrides)
    hooks = OmegaConf.select(raw, "agentlightning.hooks", default=None, throw_on_resolution_failure=False)
    if not isinstance(hooks, str) and not (OmegaConf.is_list(hooks) and all(isinstance(h, str) for h in hooks)):
        hooks = None  # malformed: validation names the key
    manager = PluginManager.from_config({"agentlightning": {"hooks": hooks}}, plugins)
    name = OmegaConf.select(raw, "agentlightning.backend", default=None, throw_on_resolution_failure=False)
    spec = _spec(manager, default_config().agentlightning.backend if name is None else name)
    return spec.load_config(config_path, overrides), manager


def _spec(manager: PluginManager, name: str) -> BackendSpec:
    return backend_spec(manager.backends.entry(name))


def _unvalidated(config_path: str | None, overrides: Sequence[str]) -> Any:
    """The YAML with the overrides merged over it, unchecked; empty when either cannot be read (the
    loader then reports why, naming the file or key)."""
    from omegaconf import OmegaConf

    try:
        user = OmegaConf.load(config_path) if config_path is not None and Path(config_path).is_file() else {}
        return OmegaConf.merge(user, OmegaConf.from_dotlist([o for o in overrides if "=" in o]))
    except Exception:
        return OmegaConf.create()
