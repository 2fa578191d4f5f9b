"""The ``agl`` entry point of this distribution: registers backend ``verl``, and verl's trackers as
metric sinks (:mod:`agl_backend_verl.verl_trackers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agl_backend_verl.config import check_verl_requirements, load_verl_config
from agl_backend_verl.verl_trackers import register_verl_trackers
from agl_core import Backend, BackendSpec, Register, hookimpl

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_core import PluginManager


def verl_backend(config: DictConfig, plugins: PluginManager) -> Backend:
    """The verl backend for a config built by :func:`load_verl_config`
    (see :class:`agl_backend_verl.run.VerlBackend`)."""
    from agl_backend_verl.run import VerlBackend

    return VerlBackend(config, plugins)


def verl_estimators() -> frozenset[str]:
    """The advantage estimators verl defines (``gae``, ``reinforce_plus_plus``...), which the backend
    runs with verl's ``compute_advantage`` (:mod:`agl_backend_verl.advantages`)."""
    from verl.trainer.ppo import core_algos

    from agl_backend_verl.advantages import is_verl_estimator

    names = {e.value for e in core_algos.AdvantageEstimator} | set(core_algos.ADV_ESTIMATOR_REGISTRY)
    return frozenset(name for name in names if is_verl_estimator(name))


def check_verl_run(config: DictConfig) -> None:
    """What ``agl check`` and ``agl train`` verify of a verl run before Ray starts: the run's
    requirements (:func:`check_verl_requirements`), that its models' dropout can be turned off as
    ``agentlightning.disable_dropout`` says (:func:`dropout_override_configs`, for a model whose config
    is on this machine), and that a Ray cluster it is to join answers as one."""
    from omegaconf import OmegaConf

    from agl_backend_verl.config import RAY_ADDRESS_KEY
    from agl_backend_verl.dropout import dropout_override_configs
    from agl_backend_verl.ray_cluster import check_reachable, cluster_address

    check_verl_requirements(config)
    dropout_override_configs(config, local_files_only=True)
    address = cluster_address({"address": OmegaConf.select(config, RAY_ADDRESS_KEY, default=None)})
    if address is not None:
        check_reachable(address, float(config.agentlightning.verl.ray_connect_timeout_seconds))


@hookimpl
def agl_register_backends(register: Register) -> None:
    # ``agl train`` validates a verl run against verl's full config, not the core schema.
    register(
        "verl",
        BackendSpec(
            verl_backend,
            load_config=load_verl_config,
            check_config=check_verl_run,
            native_estimators=verl_estimators,
        ),
    )


@hookimpl
def agl_register_metric_sinks(register: Register) -> None:
    register_verl_trackers(register)
