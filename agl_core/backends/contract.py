"""What a training backend gives ``agl train``: the objects ``agl_register_backends`` registers.

A plugin registers either a :class:`BackendSpec` (a factory and the config loader its runs are
validated with) or a bare :data:`BackendFactory`, which stands for ``BackendSpec(factory)``: its runs
are validated against the core schema (:func:`agl_core.config.load_config`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

from agl_core.config import load_config

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_core.data import StepSamples

    from agl_core.plugins import PluginManager
    from agl_core.plugins.registry import RegistryEntry

__all__ = ["Backend", "BackendFactory", "BackendSpec", "ConfigLoader", "OnStep", "backend_spec"]

OnStep = Callable[[int, int, Mapping[str, float], "StepSamples"], None]
"""``on_step(step, total_steps, metrics, samples)``: called after every training step with the step's
metrics (name → float) and sample tables (:data:`~agl_core.data.StepSamples`: the pipeline's
``trajectories`` and ``mismatches``, ``{}`` when there are none); a validation before the first step
is reported as step 0. ``agl train``'s ``on_step`` also takes the call without ``samples``, from a
backend that has none."""


class Backend(Protocol):
    def fit(self, on_step: OnStep | None = None) -> None:
        """Train until the configured number of steps (continuing from a checkpoint where the
        config says so), calling ``on_step`` after every step. Before its first rollout it calls
        ``plugins.on_startup(config)`` once, in the process where the rollout hooks run."""


BackendFactory = Callable[["DictConfig", "PluginManager"], Backend]
"""``factory(config, plugins)``: a backend for the validated run config and the run's plugin manager."""

ConfigLoader = Callable[[str | None, Sequence[str]], "DictConfig"]
"""``load(path, overrides)``: the validated run config from a YAML file (or none) and ``key=value``
overrides; bad input raises :class:`~agl_core.config.ConfigError` naming the key."""


@attrs.frozen
class BackendSpec:
    """A backend as registered: its factory, and the loader that validates its runs (a backend whose
    schema is larger than the core's, like verl's, brings its own)."""

    factory: BackendFactory
    load_config: ConfigLoader = load_config


def backend_spec(entry: RegistryEntry) -> BackendSpec:
    """The :class:`BackendSpec` of a backends registry entry."""
    if isinstance(entry.obj, BackendSpec):
        return entry.obj
    if callable(entry.obj):
        return BackendSpec(entry.obj)
    raise TypeError(
        f"plugin {entry.plugin_name!r} registered backend {entry.name!r} as a {type(entry.obj).__name__}; "
        "register a BackendSpec or a factory(config, plugins)"
    )
