"""The verl backend's config: verl's full ``ppo_trainer`` defaults, agl's section and Agent Lightning's overlay.

The base is composed without Hydra from the flattened ``_generated_ppo_trainer.yaml`` verl ships (the
same values Hydra's compose of ``ppo_trainer`` yields), plus the typed ``agentlightning`` section of
:class:`agl_core.config.AgentLightningConfig`, plus :func:`overlay` (Agent Lightning v1.0's values).
:func:`load_verl_config` then merges the user's YAML and ``key=value`` overrides over it through
:func:`agl_core.config.merge_config` and validates once: unknown keys (struct mode), the types of verl's
keys (a value must have the type of verl's default, or one its config dataclass declares: see
:mod:`agl_backend_verl.verl_dataclasses`, whose fields the defaults omit are known keys too), then
the core's ranges and cross-key rules (:func:`agl_core.config.checks.validate`), and the estimator
choices this backend cannot run. A verl run config written for Hydra (``defaults: [ppo_trainer,
_self_]``, ``hydra.searchpath``, as Agent Lightning v1.0's verl config is) loads as it is: its base is
what those lines compose (:mod:`agl_core.config.composition`).

``algorithm.enable_rollout_level_advantage`` is Agent Lightning's key and stays where its configs put
it, but verl's ``AlgoConfig`` dataclass refuses unknown keys: verl's legacy ``RayPPOTrainer`` reads the
section as a ``DictConfig`` and never builds an ``AlgoConfig`` from it, and every algorithm section this
backend hands to verl code comes from :func:`verl_algorithm_config`, which leaves the key out.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Sequence
from functools import cache
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf, open_dict

from agl_backend_verl.moved_keys import with_moved_key_hint
from agl_backend_verl.verl_dataclasses import declared_fields, type_names
from agl_backend_verl.verl_version import VERL_INSTALL, check_verl_version
from agl_core import AgentLightningConfig, ConfigError, default_config, merge_config, validate_config

ROLLOUT_LEVEL_KEY = "enable_rollout_level_advantage"

# Keys whose core-schema value (Agent Lightning v1.0's, or agl's) applies over verl's default: verl's
# gae estimator gives per-token advantages, which cannot be computed once per rollout; trainer.seed is
# the core schema's one trainer key that verl's trainer section lacks.
FROM_CORE = (
    f"algorithm.{ROLLOUT_LEVEL_KEY}",
    "algorithm.adv_estimator",
    "actor_rollout_ref.actor.policy_loss.loss_mode",
    "trainer.seed",
)
# Agent Lightning v1.0's values (its verl config) for verl keys the core schema does not hold.
AGENT_LIGHTNING_VERL_VALUES: dict[str, Any] = {
    "data": {"filter_overlong_prompts": False},
    "actor_rollout_ref": {"actor": {"calculate_entropy": True}, "rollout": {"mode": "async"}},
}


# ray.init's arguments agl reads from verl's ``ray_kwargs.ray_init`` beyond those verl's defaults
# list: the cluster to join (HOST:PORT of its head, auto, or null to start a Ray of agl's own).
RAY_INIT_KEYS: dict[str, Any] = {"ray_kwargs": {"ray_init": {"address": None}}}
RAY_ADDRESS_KEY = "ray_kwargs.ray_init.address"


def overlay() -> DictConfig:
    """What goes over verl's defaults: :data:`AGENT_LIGHTNING_VERL_VALUES`, :data:`RAY_INIT_KEYS` and
    the core defaults of :data:`FROM_CORE` (read from the core schema, so they are stated once)."""
    core = default_config()
    values = OmegaConf.merge(AGENT_LIGHTNING_VERL_VALUES, RAY_INIT_KEYS)
    for key in FROM_CORE:
        OmegaConf.update(values, key, OmegaConf.select(core, key), force_add=True)
    return values


# The Hydra config the base holds: a user file's ``defaults`` may name it (verl's run configs do).
COMPOSED = ("ppo_trainer",)

# Estimators this backend refuses, with the reason given to the user.
UNSUPPORTED_ESTIMATORS = {
    "remax": "REMAX needs a greedy baseline generation per prompt, which the gateway's agents do not produce",
}


def generated_defaults_path() -> str:
    """Path of the flattened ``ppo_trainer`` defaults inside the installed verl (without importing verl),
    once the installed verl is one this backend supports."""
    check_verl_version()
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "agentlightning.backend",
            f"verl's distribution is installed but its package is not importable: {VERL_INSTALL}",
        )
    return os.path.join(os.path.dirname(spec.origin), "trainer", "config", "_generated_ppo_trainer.yaml")


@cache
def _verl_defaults() -> DictConfig:
    cfg = OmegaConf.load(generated_defaults_path())
    assert isinstance(cfg, DictConfig)
    return cfg


@cache
def _verl_fields() -> dict[str, Any]:
    """Dotted key -> annotation of every field verl's config dataclasses declare for its defaults' sections."""
    return declared_fields(_verl_defaults())


@cache
def _omitted_fields() -> tuple[str, ...]:
    """The fields verl's dataclasses declare but its defaults leave out (``fsdp_config.mixed_precision``)."""
    defaults = _verl_defaults()
    return tuple(key for key in _verl_fields() if OmegaConf.select(defaults, key, default=_NO_TYPE) is _NO_TYPE)


def verl_base() -> DictConfig:
    """verl's defaults + the typed ``agentlightning`` section + :func:`overlay`, in struct mode.

    Free-form mappings left empty by default (verl's ``override_config``, ``engine_kwargs``...; agl's
    ``agentlightning.local.env_map``) stay open, so users can fill them as they would with Hydra's
    ``+key=value``. The fields verl's dataclasses declare but its defaults omit are there as ``???``,
    so a user may set them; :func:`load_verl_config` drops those nobody set.
    """
    agl = OmegaConf.structured(AgentLightningConfig)
    agl.backend = "verl"
    omitted = OmegaConf.from_dotlist([f"{key}={MISSING}" for key in _omitted_fields()])
    cfg = OmegaConf.merge(_verl_defaults(), omitted, {"agentlightning": agl}, overlay())
    assert isinstance(cfg, DictConfig)
    OmegaConf.set_struct(cfg, True)
    for _key, node in _walk(cfg):
        if isinstance(node, DictConfig) and len(node) == 0:
            OmegaConf.set_struct(node, False)
    return cfg


def load_verl_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> DictConfig:
    """The validated run config for backend ``verl``; every error is a :class:`ConfigError` naming its key."""
    base = verl_base()
    try:
        cfg = merge_config(path, overrides, base=base.copy(), composed=COMPOSED)
    except ConfigError as exc:
        raise with_moved_key_hint(exc) from None
    _drop_unset(cfg, _omitted_fields())
    check_types(cfg, base)
    validate_config(cfg)
    validate_verl(cfg)
    return cfg


_NO_TYPE = object()  # an interpolation or a mandatory value left unset: no default type


def _drop_unset(cfg: DictConfig, keys: Sequence[str]) -> None:
    """Remove the ``keys`` still ``???``, so verl gets its dataclasses' defaults for them, as without agl."""
    for key in keys:
        parent_key, _, name = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if isinstance(parent, DictConfig) and name in parent.keys() and OmegaConf.is_missing(parent, name):
            with open_dict(parent):
                del parent[name]


def _walk(node: DictConfig, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every key under ``node``; interpolations and ``???`` read as ``_NO_TYPE``."""
    for key in node.keys():
        dotted = f"{prefix}{key}"
        if OmegaConf.is_interpolation(node, key) or OmegaConf.is_missing(node, key):
            yield dotted, _NO_TYPE
            continue
        value = node[key]
        yield dotted, value
        if isinstance(value, DictConfig):
            yield from _walk(value, dotted + ".")


def _type_name(value: Any) -> str | None:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (ListConfig, list)):
        return "list"
    if isinstance(value, (DictConfig, dict)):
        return "mapping"
    return None


def check_types(cfg: DictConfig, base: DictConfig) -> None:
    """Each value must have the type of its default in ``base`` (an int is accepted for a float), or
    one the field's annotation in verl's dataclass admits (``target_modules``: a str or a list).

    Defaults that are ``None`` or interpolations carry no type and accept anything. verl writes some
    float settings with an int default (``rollout.top_p: 1``, ``val_kwargs.temperature: 0``); a float
    is accepted there when the core schema types the same key as a float.
    """
    core, fields = default_config(), _verl_fields()
    for key, default in _walk(base):
        expected = _type_name(default)
        if expected is None:
            continue
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        got = _type_name(value)
        if value is None or got == expected or (expected == "float" and got == "int"):
            continue
        if expected == "int" and got == "float" and isinstance(OmegaConf.select(core, key, default=None), float):
            continue
        declared = type_names(fields[key]) if key in fields else frozenset()
        if declared is None or got in declared:
            continue
        raise ConfigError(
            key, f"must be a {expected} like verl's default {default!r}, got {got or type(value).__name__} {value!r}"
        )
    for key in _omitted_fields():
        value = OmegaConf.select(cfg, key, default=None)
        declared, got = type_names(fields[key]), _type_name(value)
        if value is None or declared is None or got in declared or ("float" in declared and got == "int"):
            continue
        raise ConfigError(
            key,
            f"must be a {' or '.join(sorted(declared))} as verl's dataclass declares it, "
            f"got {got or type(value).__name__} {value!r}",
        )


def validate_verl(cfg: DictConfig) -> None:
    """Rules of this backend that the core's :func:`~agl_core.config.checks.validate` does not know."""
    estimator = str(cfg.algorithm.adv_estimator)
    if estimator in UNSUPPORTED_ESTIMATORS:
        raise ConfigError(
            "algorithm.adv_estimator", f"{estimator!r} is not supported: {UNSUPPORTED_ESTIMATORS[estimator]}"
        )
    if cfg.algorithm[ROLLOUT_LEVEL_KEY] and estimator == "gae":
        raise ConfigError(
            "algorithm.adv_estimator",
            "'gae' gives per-token advantages, which cannot be computed once per rollout; choose an outcome "
            f"estimator (grpo, rloo, ...) or set algorithm.{ROLLOUT_LEVEL_KEY}=false",
        )
    if estimator == "gae" and cfg.critic.enable is not None and not cfg.critic.enable:
        raise ConfigError(
            "critic.enable",
            "is false, but 'gae' needs the critic's values: enable the critic or choose another estimator",
        )
    address = OmegaConf.select(cfg, RAY_ADDRESS_KEY, default=None)
    if address is not None and not is_ray_address(address):
        raise ConfigError(
            RAY_ADDRESS_KEY,
            f"must be HOST:PORT (the Ray cluster's head), auto, local, a ray:// URL or null, got {address!r}",
        )
    actor = cfg.actor_rollout_ref.actor
    clip_grad = OmegaConf.select(actor, "optim.clip_grad", default=None)
    if clip_grad is not None and float(actor.grad_clip) != float(clip_grad):
        raise ConfigError(
            "actor_rollout_ref.actor.grad_clip",
            f"is {actor.grad_clip}, but verl clips gradients at actor_rollout_ref.actor.optim.clip_grad ({clip_grad}) "
            "and never reads this key, which the torch backend clips at: give both the same value",
        )


def is_ray_address(value: Any) -> bool:
    """Whether ``value`` names a Ray cluster as ``ray.init(address=...)`` takes it."""
    if not isinstance(value, str):
        return False
    host, sep, port = value.rpartition(":")
    return value in ("auto", "local") or value.startswith("ray://") or (bool(sep and host) and port.isdigit())


def check_verl_requirements(cfg: DictConfig) -> None:
    """What this backend needs beyond a valid config before it starts Ray (``agl check`` runs it too):
    the gateway's URL, verl's rollout engine and the model."""
    if cfg.agentlightning.agl_base_url is None and not cfg.agentlightning.replay:
        raise ConfigError(
            "agentlightning.agl_base_url",
            "backend 'verl' runs agents through the gateway: set its URL (or replay a recording)",
        )
    rollout = cfg.actor_rollout_ref.rollout
    if "name" not in rollout or OmegaConf.is_missing(rollout, "name"):
        raise ConfigError(
            "actor_rollout_ref.rollout.name", "backend 'verl' needs verl's rollout engine named: vllm (or sglang)"
        )
    if not cfg.actor_rollout_ref.model.path:
        raise ConfigError(
            "actor_rollout_ref.model.path", "the policy's model (a local folder or a Hugging Face id) is not set"
        )


def verl_algorithm_config(cfg: DictConfig) -> DictConfig:
    """The ``algorithm`` section as verl's ``AlgoConfig`` accepts it (Agent Lightning's key left out)."""
    section = OmegaConf.to_container(cfg.algorithm, resolve=True)
    assert isinstance(section, dict)
    section.pop(ROLLOUT_LEVEL_KEY, None)
    return OmegaConf.create(section)
