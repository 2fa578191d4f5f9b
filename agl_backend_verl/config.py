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
from collections.abc import Iterator, Mapping, Sequence
from functools import cache
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf, open_dict

from agl_backend_verl.moved_keys import with_moved_key_hint
from agl_backend_verl.verl_dataclasses import declared_fields, type_names
from agl_backend_verl.verl_version import VERL_INSTALL, check_verl_version
from agl_core import (
    AgentLightningConfig,
    ConfigError,
    ConfigFile,
    check_rollout_source,
    default_config,
    merge_config,
    validate_config,
)

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


# ray.init's arguments that size a new local Ray; Ray refuses them when it joins a cluster, so agl
# leaves them out there (agl_backend_verl.ray_cluster).
NEW_RAY_ONLY = ("num_cpus", "num_gpus", "resources", "labels", "object_store_memory", "_memory", "_temp_dir")
# ray.init's arguments agl reads from verl's ``ray_kwargs.ray_init`` beyond those verl's defaults
# list: the cluster to join (HOST:PORT of its head, auto, or null to start a Ray of agl's own), and
# the sizes and folder of a new Ray (null: Ray's defaults).
RAY_INIT_KEYS: dict[str, Any] = {"ray_kwargs": {"ray_init": {"address": None, **dict.fromkeys(NEW_RAY_ONLY)}}}
RAY_ADDRESS_KEY = "ray_kwargs.ray_init.address"
# TransferQueue's own keys that verl's defaults leave out: the Ray custom resource a node must offer
# to hold a storage unit (null: any node). A unit lost with its node loses the data it holds.
TRANSFER_QUEUE_KEYS: dict[str, Any] = {
    "transfer_queue": {"backend": {"SimpleStorage": {"required_node_resource": None}}}
}


def overlay() -> DictConfig:
    """What goes over verl's defaults: :data:`AGENT_LIGHTNING_VERL_VALUES`, :data:`RAY_INIT_KEYS`,
    :data:`TRANSFER_QUEUE_KEYS` and the core defaults of :data:`FROM_CORE` (read from the core schema,
    so they are stated once)."""
    core = default_config()
    values = OmegaConf.merge(AGENT_LIGHTNING_VERL_VALUES, RAY_INIT_KEYS, TRANSFER_QUEUE_KEYS)
    for key in FROM_CORE:
        OmegaConf.update(values, key, OmegaConf.select(core, key), force_add=True)
    return values


# The Hydra config the base holds: a user file's ``defaults`` may name it (verl's run configs do).
COMPOSED = ("ppo_trainer",)
# What Hydra's compose of ``ppo_trainer`` adds that the flattened defaults leave out: its model-engine
# group choice, a top-level key verl itself never reads. The base is that choice's composition.
MODEL_ENGINE = "dp"

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
    composition = {"model_engine": MODEL_ENGINE}
    cfg = OmegaConf.merge(_verl_defaults(), composition, omitted, {"agentlightning": agl}, overlay())
    assert isinstance(cfg, DictConfig)
    OmegaConf.set_struct(cfg, True)
    for _key, node in _walk(cfg):
        if isinstance(node, DictConfig) and len(node) == 0:
            OmegaConf.set_struct(node, False)
    return cfg


def load_verl_config(
    path: str | os.PathLike[str] | ConfigFile | None = None, overrides: Sequence[str] = ()
) -> DictConfig:
    """The validated run config for backend ``verl`` from a YAML file (its path, or the
    :class:`~agl_core.ConfigFile` already read); every error is a :class:`ConfigError` naming its key."""
    base = verl_base()
    try:
        cfg = merge_config(path, overrides, base=base.copy(), composed=COMPOSED)
    except ConfigError as exc:
        raise with_moved_key_hint(exc) from None
    _drop_unset(cfg, _omitted_fields())
    check_types(cfg, base)
    validate_config(cfg)
    validate_verl(cfg)
    fill_critic(cfg)
    return cfg


IN_MEMORY = "the config given in code"


def load_verl_config_mapping(config: Mapping[str, Any] | DictConfig, overrides: Sequence[str] = ()) -> DictConfig:
    """:func:`load_verl_config` of a config held in memory: the dict an Agent Lightning v1.0 script
    builds (its ``verl_default_config()``), or the ``DictConfig`` Hydra composes from its verl config
    (``defaults: [ppo_trainer, _self_]``), as ``agentlightning.verl.entrypoint.run_ppo`` took it.

    It loads as a file would: over verl's defaults, agl's own ``agentlightning`` keys take their
    defaults where the script set none (``agentlightning.replay`` among them), and an unknown,
    ill-typed or out-of-range key, or one agl does not honour, is a :class:`ConfigError` naming the
    key — before any Ray worker starts. The caller's object is not changed."""
    return load_verl_config(ConfigFile.from_mapping(config, IN_MEMORY), overrides)


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
    check_v1(cfg)
    if cfg.model_engine not in (None, MODEL_ENGINE):
        raise ConfigError(
            "model_engine",
            f"is {cfg.model_engine!r}, but this backend's base is verl's ppo_trainer composed with model_engine "
            f"{MODEL_ENGINE!r} (FSDP): its actor, reference and critic sections are that engine's; the "
            "megatron, torchtitan and veomni engines' configs are not composed by agl",
        )
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
    if OmegaConf.select(cfg, "actor_rollout_ref.rollout.enable_rollout_routing_replay", default=False):
        raise ConfigError(
            "actor_rollout_ref.rollout.enable_rollout_routing_replay",
            "is true, but the routes vLLM records reach an update only through MoE router replay (R3), which "
            "agl does not honour (see actor_rollout_ref.actor.megatron.router_replay): set it to false",
        )
    if OmegaConf.select(cfg, "actor_rollout_ref.actor.use_prefix_grouper", default=False):
        raise ConfigError(
            "actor_rollout_ref.actor.use_prefix_grouper",
            "is true, but verl 0.9.1 computes nothing shared with it (no worker calls the grouper's forward, "
            "and the V1 trainer does not read the key): set it to false; agl's prefix sharing runs on the "
            "torch backend (agentlightning.torch.share_prefixes)",
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


V1_MODES = ("sync", "colocate_async", "separate_async")
AGL_AGENT_LOOP_MANAGER = "agl_backend_verl.agent_loop.RolloutLoopManager"


def trainer_mode(cfg: DictConfig) -> str:
    """The V1 trainer mode a run uses: ``trainer.v1.trainer_mode``, except that Agent Lightning's
    ``agentlightning.async_rollout.enabled: true`` over verl's default ``sync`` means ``colocate_async``
    (the mode whose rollouts run across weight updates on the trainer's own replicas)."""
    mode = str(cfg.trainer.v1.trainer_mode)
    return "colocate_async" if mode == "sync" and cfg.agentlightning.async_rollout.enabled else mode


def warmup_batches(cfg: DictConfig) -> float:
    """``trainer.v1.<mode>.num_warmup_batches`` of an async run: with Agent Lightning's async rollout,
    the batches beyond the step's own that keep ``async_train_batch_size`` groups in flight."""
    mode = trainer_mode(cfg)
    section = cfg.trainer.v1[mode]
    if not cfg.agentlightning.async_rollout.enabled:
        return float(section.num_warmup_batches)
    in_flight = int(cfg.agentlightning.async_rollout.async_train_batch_size)
    return max(0.0, in_flight / int(cfg.data.train_batch_size) - 1.0)


def check_v1(cfg: DictConfig) -> None:
    """What of verl's V1 trainer this backend runs, refused by key where it cannot."""
    if not cfg.trainer.use_v1:
        raise ConfigError(
            "trainer.use_v1",
            "is false, but backend 'verl' runs verl's V1 trainer only (verl 0.9 deprecates the legacy "
            "RayPPOTrainer and will remove it): set trainer.use_v1=true",
        )
    mode = str(cfg.trainer.v1.trainer_mode)
    if mode not in V1_MODES:
        raise ConfigError("trainer.v1.trainer_mode", f"is {mode!r}; backend 'verl' runs {', '.join(V1_MODES)}")
    manager = OmegaConf.select(cfg, "actor_rollout_ref.rollout.agent.agent_loop_manager_class", default=None)
    if manager not in (None, AGL_AGENT_LOOP_MANAGER):
        raise ConfigError(
            "actor_rollout_ref.rollout.agent.agent_loop_manager_class",
            f"is {manager!r}, but agl's rollouts come from the Agent Lightning gateway (or the embedded agents, "
            f"or a recording) through {AGL_AGENT_LOOP_MANAGER}: leave it unset",
        )
    if OmegaConf.select(cfg, "algorithm.filter_groups.enable", default=False):
        raise ConfigError(
            "algorithm.filter_groups.enable",
            "is true, but agl's batch shaping already drops groups whose rewards are all equal first "
            "(training/n_sample_dropped/same_reward); verl's DAPO filter reads reward scores agl's rollout "
            "records do not hold: set it to false",
        )
    if trainer_mode(cfg) == "separate_async":
        sync_steps = int(cfg.trainer.v1.separate_async.parameter_sync_step)
        mini = int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
        if int(cfg.data.train_batch_size) != sync_steps * mini:
            raise ConfigError(
                "trainer.v1.separate_async.parameter_sync_step",
                f"is {sync_steps}, but separate_async trains data.train_batch_size ({cfg.data.train_batch_size}) "
                f"groups as parameter_sync_step mini-batches of actor_rollout_ref.actor.ppo_mini_batch_size "
                f"({mini}): their product must equal the batch",
            )
        check_separate_async(cfg)


def check_separate_async(cfg: DictConfig) -> None:
    """verl's other rules for ``separate_async`` (asserts in its trainer, inside Ray), by key, and the
    one of agl: the gateway cannot follow verl lending the trainer's replicas to generation."""
    rollout = cfg.actor_rollout_ref.rollout
    for key in ("nnodes", "n_gpus_per_node"):
        if int(rollout[key]) <= 0:
            raise ConfigError(
                f"actor_rollout_ref.rollout.{key}",
                f"is {rollout[key]}, but separate_async runs its rollout replicas on a pool of their own: "
                "actor_rollout_ref.rollout.nnodes x actor_rollout_ref.rollout.n_gpus_per_node devices",
            )
    replica = (
        int(rollout.tensor_model_parallel_size)
        * int(rollout.data_parallel_size)
        * int(rollout.pipeline_model_parallel_size)
    )
    if int(rollout.nnodes) * int(rollout.n_gpus_per_node) % replica:
        raise ConfigError(
            "actor_rollout_ref.rollout.n_gpus_per_node",
            f"is {rollout.n_gpus_per_node} on {rollout.nnodes} node(s), but the rollout pool holds whole replicas of "
            f"tensor x data x pipeline parallel size = {replica} devices",
        )
    if rollout.checkpoint_engine.backend == "naive":
        raise ConfigError(
            "actor_rollout_ref.rollout.checkpoint_engine.backend",
            "is 'naive', which only feeds replicas inside the trainer's ranks; separate_async sends the weights "
            "to its rollout pool through another engine (nccl, nixl, ...; agl_gloo with trainer.device=cpu)",
        )
    if not cfg.actor_rollout_ref.hybrid_engine:
        raise ConfigError(
            "actor_rollout_ref.hybrid_engine",
            "is false, which verl 0.9.1's separate_async trainer cannot start with: it logs the standalone-only "
            'set-up with logger.info(..., flush=True) and stops with "TypeError: Logger._log() got an unexpected '
            "keyword argument 'flush'\" (verl/trainer/ppo/v1/trainer_separate_async.py); leave it true (the "
            "trainer's own replicas then serve verl's validation switch only, agl's agents use the rollout pool's)",
        )
    if cfg.trainer.v1.separate_async.hybrid_rollout.enable_switch:
        raise ConfigError(
            "trainer.v1.separate_async.hybrid_rollout.enable_switch",
            "is true, but agl's agents reach the replicas the gateway registers (the rollout pool's), not verl's "
            "load balancer: the trainer's replicas verl would lend to generation between steps would get no "
            "requests, and each switch would cost a weight push and a sleep; set it to false",
        )


CRITIC_PLACEHOLDER = "~/models/deepseek-llm-7b-chat"
"""verl's default ``critic.model.path`` (its YAML names a model nobody has locally)."""


def uses_critic(cfg: DictConfig) -> bool:
    """verl's rule: ``critic.enable`` when set, else whether the estimator is ``gae``."""
    if cfg.critic.enable is not None:
        return bool(cfg.critic.enable)
    return str(cfg.algorithm.adv_estimator) == "gae"


def fill_critic(cfg: DictConfig) -> None:
    """When the critic is used: its model defaults to the policy's (in place of verl's placeholder)
    and its micro-batch to the actor's, so a ``gae`` run needs no critic keys of its own."""
    if not uses_critic(cfg):
        return
    with open_dict(cfg):
        if OmegaConf.select(cfg, "critic.model.path") == CRITIC_PLACEHOLDER:
            cfg.critic.model.path = cfg.actor_rollout_ref.model.path
        critic = cfg.critic
        if critic.ppo_micro_batch_size_per_gpu is None and critic.ppo_micro_batch_size is None:
            critic.ppo_micro_batch_size_per_gpu = cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu


def check_layout(cfg: DictConfig) -> None:
    """verl's divisibility rules that would otherwise fail inside its Ray workers, by key: the
    rollout's parallel size must divide the trainer's ranks, and every micro-batch size must divide
    a rank's share of a mini-batch (agl trains whole mini-batches of ``ppo_mini_batch_size ×
    rollout.n`` rows, and verl's dispatch gives each data-parallel rank an equal share)."""
    ranks = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    rollout = cfg.actor_rollout_ref.rollout
    replica = int(rollout.tensor_model_parallel_size) * int(rollout.data_parallel_size)
    replica *= int(rollout.pipeline_model_parallel_size)
    if ranks % replica:
        raise ConfigError(
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            f"a rollout replica spans tensor x data x pipeline parallel = {replica} ranks, which does not divide "
            f"the trainer's trainer.nnodes x trainer.n_gpus_per_node = {ranks} ranks (verl runs its replicas on them)",
        )
    actor = cfg.actor_rollout_ref.actor
    if actor.use_dynamic_bsz:
        return
    mini_rows = int(actor.ppo_mini_batch_size) * int(rollout.n)
    if mini_rows % ranks:
        raise ConfigError(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"a mini-batch of ppo_mini_batch_size x rollout.n = {mini_rows} rows cannot be shared equally by "
            f"{ranks} data-parallel ranks",
        )
    share = mini_rows // ranks
    for key in (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        *(["critic.ppo_micro_batch_size_per_gpu"] if uses_critic(cfg) else []),
    ):
        micro = OmegaConf.select(cfg, key)
        if micro is not None and share % int(micro):
            raise ConfigError(
                key,
                f"is {micro}, which does not divide a rank's share of a mini-batch: ppo_mini_batch_size x "
                f"rollout.n / ranks = {mini_rows} / {ranks} = {share} rows (verl cuts each share into micro-batches "
                "of this size)",
            )


def check_with_verl(cfg: DictConfig) -> None:
    """verl's own ``validate_config``, before Ray starts; what it refuses is a :class:`ConfigError`
    naming the key its message names."""
    import re

    from hydra.errors import InstantiationException
    from verl.trainer.ppo.utils import need_reference_policy
    from verl.utils.config import validate_config

    try:
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=uses_critic(cfg))
    except (AssertionError, ValueError, TypeError, InstantiationException) as exc:
        # A section verl builds into its dataclass fails inside Hydra's instantiate, whose message
        # names the section (full_key) and whose cause says what is wrong.
        keys = re.findall(r"(?:actor_rollout_ref|critic|data|trainer|algorithm)(?:\.\w+)+", str(exc))
        key = max(keys, key=len) if keys else "actor_rollout_ref"
        reason = exc.__cause__ if isinstance(exc, InstantiationException) and exc.__cause__ else exc
        raise ConfigError(key, f"verl refuses the config: {reason}") from None


def is_ray_address(value: Any) -> bool:
    """Whether ``value`` names a Ray cluster as ``ray.init(address=...)`` takes it."""
    if not isinstance(value, str):
        return False
    host, sep, port = value.rpartition(":")
    plain = bool(sep and host) and port.isdigit() and "/" not in host  # HOST:PORT, not a URL
    return value in ("auto", "local") or value.startswith("ray://") or plain


def check_verl_requirements(cfg: DictConfig) -> None:
    """What this backend needs beyond a valid config before it starts Ray (``agl check`` runs it too):
    verl's rollout engine, the model, without a gateway or a recording the embedded agents' class,
    the critic's keys (:func:`fill_critic`), verl's divisibility rules (:func:`check_layout`) and
    verl's own validation (:func:`check_with_verl`)."""
    rollout = cfg.actor_rollout_ref.rollout
    if "name" not in rollout or OmegaConf.is_missing(rollout, "name"):
        raise ConfigError(
            "actor_rollout_ref.rollout.name", "backend 'verl' needs verl's rollout engine named: vllm (or sglang)"
        )
    if not cfg.actor_rollout_ref.model.path:
        raise ConfigError(
            "actor_rollout_ref.model.path", "the policy's model (a local folder or a Hugging Face id) is not set"
        )
    check_rollout_source(cfg)
    check_layout(cfg)
    check_with_verl(cfg)


def verl_algorithm_config(cfg: DictConfig) -> DictConfig:
    """The ``algorithm`` section as verl's ``AlgoConfig`` accepts it (Agent Lightning's key left out)."""
    section = OmegaConf.to_container(cfg.algorithm, resolve=True)
    assert isinstance(section, dict)
    section.pop(ROLLOUT_LEVEL_KEY, None)
    return OmegaConf.create(section)
