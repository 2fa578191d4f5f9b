"""agl's policy losses and advantage estimators, registered in verl's registries in every process.

verl runs the policy loss inside its Ray workers, which look it up by name in
``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY``. This module fills that registry (and the
advantage-estimator registry) from agl's plugin manager, so built-ins and third-party plugins
(entry points in group ``agl``) are both there. It also registers verl's CPU mode
(:mod:`agl_backend_verl.cpu`), and patches verl for vision-language rows
(:mod:`agl_backend_verl.mrope_positions`) and for a TRL without the value-head model verl imports
(:mod:`agl_backend_verl.trl_value_head`). It runs on import, and two paths import it in every process that
imports verl:

1. the entry point ``agl`` in group ``verl.plugins``, which ``import verl`` loads in verl 0.9 — so it
   works whoever started Ray, with no runtime env at all;
2. ``VERL_USE_EXTERNAL_MODULES`` naming this module, which :func:`ray_runtime_env` adds to the Ray
   runtime env when agl starts Ray (it still works with ``VERL_USE_EXTERNAL_PLUGINS=none``).

Plugin settings (``agentlightning.plugins``) reach the workers as JSON in ``AGL_PLUGIN_SETTINGS``,
which :func:`plugin_settings_env` makes from the run's config and agl adds to the Ray runtime env
when it starts Ray: the losses and estimators registered there are built with the configured
settings, as in the driver. Without it (Ray started elsewhere) they get their defaults.

verl's own names win: an agl loss or estimator whose name verl already defines (``grpo``, ``rloo``...)
is not registered, and is listed in :data:`SKIPPED`. verl swallows import errors of its plugins, so a
failure here is logged and kept in :data:`REGISTRATION_ERROR`; :func:`ensure_registered` raises it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from agl_backend_verl import mrope_positions, trl_value_head
from agl_backend_verl.cpu import register as register_cpu_mode
from agl_backend_verl.policy_loss import as_verl_policy_loss
from agl_core import AdvantageSettings, PluginManager, TrainingRow, UsageError

logger = logging.getLogger(__name__)

MODULE = __name__
EXTERNAL_MODULES_ENV = "VERL_USE_EXTERNAL_MODULES"
PLUGIN_SETTINGS_ENV = "AGL_PLUGIN_SETTINGS"

REGISTERED: dict[str, list[str]] = {"policy_losses": [], "advantage_estimators": []}
SKIPPED: dict[str, str] = {}
REGISTRATION_ERROR: list[BaseException] = []


def verl_advantage_estimator(estimate: Any, name: str) -> Any:
    """An agl estimator with verl's estimator signature, for ``ADV_ESTIMATOR_REGISTRY``.

    verl passes per-row tensors; each row becomes one rollout of group ``index[i]`` whose reward is
    the row's summed ``token_level_rewards`` (verl's outcome convention).
    """

    def verl_estimator(
        token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Any = None, index: Any = None, **_: Any
    ):
        if index is None:
            raise UsageError(f"advantage estimator {name!r} needs the group index (uid) of every row")
        settings = AdvantageSettings.from_config(SimpleNamespace(algorithm={} if config is None else config))
        masks = response_mask.detach().cpu().numpy().astype(np.int8)
        rewards = token_level_rewards.detach().sum(dim=-1).float().cpu().tolist()
        rows = [
            TrainingRow(
                prompt_ids=[0],
                response_ids=np.zeros(len(mask), dtype=np.int64),
                response_mask=mask,
                reward=reward,
                rollout_id=f"row-{i}",
                group_id=str(index[i]),
            )
            for i, (mask, reward) in enumerate(zip(masks, rewards))
        ]
        per_row = estimate(rows, settings).per_row
        advantages = torch.as_tensor(np.stack(per_row), dtype=torch.float32, device=token_level_rewards.device)
        return advantages, advantages

    verl_estimator.__name__ = f"agl_{name}"
    return verl_estimator


def plugin_settings_env(config: Any) -> dict[str, str]:
    """The workers' ``AGL_PLUGIN_SETTINGS``: the run's ``agentlightning.plugins`` as JSON (none when empty)."""
    section = OmegaConf.select(config, "agentlightning.plugins", default=None)
    if not section:
        return {}
    return {PLUGIN_SETTINGS_ENV: json.dumps(OmegaConf.to_container(section, resolve=True), sort_keys=True)}


def worker_plugins() -> PluginManager:
    """The plugin manager of a process verl imports this module in (built-ins and entry points),
    configured with the sections of ``AGL_PLUGIN_SETTINGS`` that its plugins declare: the driver has
    checked them all, and sections of plugins only the driver loads (hook files, plugins given in
    code) have no use here."""
    plugins = PluginManager()
    raw = os.environ.get(PLUGIN_SETTINGS_ENV)
    if raw:
        try:
            sections = json.loads(raw)
        except ValueError as exc:
            raise UsageError(f"{PLUGIN_SETTINGS_ENV} is not JSON ({exc}): {raw[:200]!r}") from exc
        declared = plugins.settings_declarations()
        plugins.configure({"agentlightning": {"plugins": {k: v for k, v in sections.items() if k in declared}}})
    return plugins


def register_into_verl(plugins: PluginManager | None = None) -> dict[str, list[str]]:
    """Register every agl loss and estimator whose name verl does not define; return the names."""
    from verl.trainer.ppo import core_algos

    plugins = plugins or worker_plugins()
    verl_estimators = {e.value for e in core_algos.AdvantageEstimator}
    for entry in plugins.policy_losses.entries():
        existing = core_algos.POLICY_LOSS_REGISTRY.get(entry.name)
        if existing is not None and not getattr(existing, "_agl_plugin", None):
            SKIPPED[f"policy loss {entry.name}"] = f"verl defines it (plugin {entry.plugin_name!r} not used by verl)"
            continue
        fn = as_verl_policy_loss(entry.obj)
        fn._agl_plugin = entry.plugin_name  # type: ignore[attr-defined]
        core_algos.POLICY_LOSS_REGISTRY[entry.name] = fn
        if entry.name not in REGISTERED["policy_losses"]:
            REGISTERED["policy_losses"].append(entry.name)
    for entry in plugins.advantage_estimators.entries():
        existing = core_algos.ADV_ESTIMATOR_REGISTRY.get(entry.name)
        if entry.name in verl_estimators or (existing is not None and not getattr(existing, "_agl_plugin", None)):
            SKIPPED[f"advantage estimator {entry.name}"] = (
                f"verl defines it (plugin {entry.plugin_name!r} not used by verl)"
            )
            continue
        fn = verl_advantage_estimator(entry.obj, entry.name)
        fn._agl_plugin = entry.plugin_name  # type: ignore[attr-defined]
        core_algos.ADV_ESTIMATOR_REGISTRY[entry.name] = fn
        if entry.name not in REGISTERED["advantage_estimators"]:
            REGISTERED["advantage_estimators"].append(entry.name)
    return REGISTERED


def ensure_registered(loss_mode: str) -> None:
    """Raise the registration failure of this process, or an error if ``loss_mode`` is unknown to verl."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    if REGISTRATION_ERROR:
        raise RuntimeError(
            f"registering agl's plugins in verl failed: {REGISTRATION_ERROR[0]}"
        ) from REGISTRATION_ERROR[0]
    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise RuntimeError(
            f"policy loss {loss_mode!r} (actor_rollout_ref.actor.policy_loss.loss_mode) is neither verl's nor a "
            f"registered agl plugin's; known: {', '.join(sorted(POLICY_LOSS_REGISTRY))}"
        )


def ray_runtime_env(runtime_env: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``runtime_env`` with this module added to ``VERL_USE_EXTERNAL_MODULES`` in its ``env_vars``."""
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    modules = [m for m in str(env_vars.get(EXTERNAL_MODULES_ENV, "")).split(",") if m]
    if MODULE not in modules:
        modules.append(MODULE)
    env_vars[EXTERNAL_MODULES_ENV] = ",".join(modules)
    env["env_vars"] = env_vars
    return env


try:
    register_cpu_mode()
except Exception as exc:  # verl would hide it: keep it for ensure_registered and say it loudly
    REGISTRATION_ERROR.append(exc)
    logger.exception("registering verl's CPU mode failed")
try:
    register_into_verl()
except Exception as exc:
    REGISTRATION_ERROR.append(exc)
    logger.exception("registering agl's policy losses and advantage estimators in verl failed")
try:
    mrope_positions.apply()
except Exception as exc:
    REGISTRATION_ERROR.append(exc)
    logger.exception("patching verl's maybe_fix_3d_position_ids failed")
try:
    trl_value_head.apply()
except Exception as exc:
    REGISTRATION_ERROR.append(exc)
    logger.exception("patching verl's is_trl_available failed")
