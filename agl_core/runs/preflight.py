"""What ``agl train`` checks before it builds the backend, and what ``agl check`` reports of it.

:func:`preflight` looks up the aggregator, advantage estimator and policy loss the config selects
(an unknown name is an error naming its key), reads the dataset files (every row must hold the
``agentlightning.local.env_map`` fields, unless an ``agl_on_enqueue`` hook may add them when it
rewrites a request) and looks up the metric sinks ``trainer.logger`` names. Its
:class:`Preflight` is everything the two commands need of those checks, so neither repeats a look-up.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs
from omegaconf import OmegaConf

from agl_core.files.datasets import check_datasets
from agl_core.plugins import PluginManager
from agl_core.runs.run_config import registered_backend
from agl_core.tracking import SinkFactory, sink_names

__all__ = ["Preflight", "preflight"]

logger = logging.getLogger(__name__)


@attrs.frozen
class Preflight:
    """A run's checked start: ``selected`` the ``(kind, name, provider)`` of each stage the config
    picks by name (aggregator, advantage estimator, policy loss; the provider is ``plugin NAME``, or
    ``backend NAME`` for an estimator the backend computes itself), ``dataset_rows`` the rows per dataset key,
    ``sinks`` the metric sinks' ``(name, factory)`` in ``trainer.logger`` order, ``enqueue_rewriters``
    the plugins whose ``agl_on_enqueue`` may rewrite a request (the rows' ``env_map`` fields were
    then not checked)."""

    selected: tuple[tuple[str, str, str], ...]
    dataset_rows: Mapping[str, int]
    sinks: tuple[tuple[str, SinkFactory], ...]
    enqueue_rewriters: tuple[str, ...]


def preflight(config: Any, manager: PluginManager) -> Preflight:
    """Check what the run ``config`` starts with (see the module docstring)."""
    backend = config.agentlightning.backend
    native = registered_backend(manager, backend).native_estimators()
    selected = []
    for registry in (manager.aggregators, manager.advantage_estimators, manager.policy_losses):
        name = OmegaConf.select(config, registry.config_key)
        if registry is manager.advantage_estimators and name in native:
            selected.append((registry.kind, name, f"backend {backend}"))
        else:
            selected.append((registry.kind, name, f"plugin {registry.entry(name).plugin_name}"))
    rewriters = tuple(manager.implementations("agl_on_enqueue"))
    rows: dict[str, int] = {}
    if config.data.train_files:  # a backend that reads no dataset files has none to check
        rows = check_datasets(config, check_env_map=not rewriters)
        if rewriters and config.agentlightning.local.env_map:
            logger.warning(
                "agentlightning.local.env_map is not checked against the dataset rows: agl_on_enqueue of %s may "
                "rewrite them (agl check says so too)",
                ", ".join(rewriters),
            )
    sinks = tuple((name, manager.metric_sinks.get(name)) for name in sink_names(config))
    return Preflight(tuple(selected), rows, sinks, rewriters)
