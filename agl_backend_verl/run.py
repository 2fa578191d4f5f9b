"""Entry points: :func:`run_ppo` for in-memory datasets, and :class:`VerlBackend` for ``agl train``.

Both start Ray when nobody has (verl's PPO runtime env + ``ray_kwargs.ray_init`` + this package in
``VERL_USE_EXTERNAL_MODULES``), then run :class:`TaskRunner` as a Ray actor: it builds verl's
workers exactly as verl's own task runner does, validates the config with verl's
``validate_config``, and trains with :class:`~agl_backend_verl.trainer.AglRayPPOTrainer`. The actor
streams each step's ``(step, total_steps, metrics, samples)`` back to the driver as it finishes (a
Ray streaming generator), where ``on_step`` sees them: ``agl train``'s metric sinks run there.

The rollout hooks run in the actor, so that is where the run's plugins live: hook files and entry
points are loaded again there from the config, and plugins given in code are pickled and sent with
the call (one that cannot be pickled is refused before Ray starts). ``agl_on_startup`` runs once,
in the actor, with the config's secrets redacted.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from agl_backend_verl.config import check_verl_requirements
from agl_backend_verl.cpu import mode as cpu_mode
from agl_backend_verl.ray_cluster import start_or_join
from agl_backend_verl.ray_errors import ray_failures_explained
from agl_backend_verl.shipping import localized_hook_files, shipped_runtime_env
from agl_backend_verl.trainer import SampleDataset, StepReport
from agl_backend_verl.verl_plugins import plugin_settings_env, ray_runtime_env
from agl_core import ConfigError, OnStep, PluginError, PluginManager


def ray_init_kwargs(config: DictConfig) -> dict[str, Any]:
    """The arguments :func:`init_ray` gives ``ray.init``: ``ray_kwargs.ray_init`` with verl's PPO
    runtime env under the user's, agl's module added to the workers' verl imports and the plugin
    settings given to the workers (:func:`~agl_backend_verl.verl_plugins.plugin_settings_env`)."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    ray_init = OmegaConf.to_container(config.ray_kwargs.get("ray_init", {}), resolve=True) or {}
    assert isinstance(ray_init, dict)
    runtime_env = {**get_ppo_ray_runtime_env(config), **(ray_init.pop("runtime_env", None) or {})}
    kwargs = {"runtime_env": ray_runtime_env(runtime_env), **{k: v for k, v in ray_init.items() if v is not None}}
    kwargs["runtime_env"]["env_vars"].update(plugin_settings_env(config))
    kwargs["runtime_env"] = shipped_runtime_env(config, kwargs["runtime_env"])
    if cpu_mode.is_cpu(config):
        kwargs["runtime_env"]["env_vars"].update(cpu_mode.runtime_env_vars())
        kwargs = cpu_mode.ray_init_kwargs(config, kwargs)
    return kwargs


def init_ray(config: DictConfig) -> None:
    """Start Ray as verl's ``run_ppo`` does (:func:`ray_init_kwargs`), unless it is running."""
    if ray.is_initialized():
        return  # the verl.plugins entry point registers agl's plugins in workers of any Ray session
    start_or_join(ray_init_kwargs(config))


def shippable(plugins: Sequence[Any]) -> list[Any]:
    """``plugins`` (given in code), checked to survive the trip to the Ray actor: each must pickle
    (Ray pickles with cloudpickle). One that does not is refused, saying how else to ship it."""
    for plugin in plugins:
        try:
            ray.cloudpickle.dumps(plugin)
        except Exception as exc:
            raise PluginError(
                f"plugin {plugin!r} was given in code, but backend 'verl' runs the hooks in a Ray actor and this "
                f"plugin cannot be pickled to get there ({type(exc).__name__}: {exc}); ship it as an entry point in "
                "group 'agl' or as a hook file named in agentlightning.hooks, or keep only picklable state in it"
            ) from exc
    return list(plugins)


def check_gpus(config: DictConfig) -> None:
    """verl's actor pool takes ``trainer.nnodes × trainer.n_gpus_per_node`` GPUs of the Ray cluster;
    say so plainly before any worker is built (verl itself would fail inside its Ray actor). In CPU
    mode (``trainer.device=cpu``) the ranks are CPU slots instead (:mod:`agl_backend_verl.cpu.mode`)."""
    if cpu_mode.is_cpu(config):
        cpu_mode.check_ray_resources(config, ray.cluster_resources())
        return
    needed = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)
    available = ray.cluster_resources().get("GPU", 0)
    if available < needed:
        raise ConfigError(
            "trainer.n_gpus_per_node",
            f"backend 'verl' trains on GPUs: it needs trainer.nnodes x trainer.n_gpus_per_node = {needed} "
            f"in the Ray cluster, which has {available:g} "
            "(or train on CPU: trainer.device=cpu, see docs/verl-backend.md)",
        )


def run_ppo(
    config: DictConfig,
    train_dataset: Sequence[Mapping[str, Any]],
    val_dataset: Sequence[Mapping[str, Any]],
    plugins: Sequence[Any] = (),
    on_step: OnStep | None = None,
) -> None:
    """Train with verl on in-memory datasets: non-empty lists of JSON-like dicts, each a rollout ``input``.

    ``config`` comes from :func:`~agl_backend_verl.config.load_verl_config`; ``on_step(step,
    total_steps, metrics, samples)`` runs in this process after every step (step 0: validation
    before training). ``plugins`` run in the Ray actor, as copies: they must pickle (:func:`shippable`).
    """
    plugins = shippable(plugins)
    train = SampleDataset(train_dataset, "train_dataset")
    val = SampleDataset(val_dataset, "val_dataset")
    check_verl_requirements(config)
    if cpu_mode.is_cpu(config):
        from verl.trainer.ppo.utils import need_critic

        cpu_mode.check_cpu_config(config, use_critic=need_critic(config))
    with ray_failures_explained():
        init_ray(config)
        check_gpus(config)
        for step, total, metrics, samples in actor_steps(
            RemoteTaskRunner.remote(), config, train.samples, val.samples, plugins
        ):
            if on_step is not None:
                on_step(step, total, metrics, samples)


def actor_steps(
    runner: Any, config: DictConfig, train_samples: list, val_samples: list, plugins: list
) -> Iterator[StepReport]:
    """Run ``runner.run`` (a :class:`TaskRunner` actor) and yield each step it streams as soon as it
    arrives; an error in the actor is raised here."""
    for ref in runner.run.options(num_returns="streaming").remote(config, train_samples, val_samples, plugins):
        yield ray.get(ref)


class TaskRunner:
    """Builds verl's workers and runs the trainer, inside the Ray cluster (as verl's task runner)."""

    def run(self, config: DictConfig, train_samples: list, val_samples: list, plugins: list) -> Iterator[StepReport]:
        """Train, yielding ``(step, total_steps, metrics, samples)`` after each step."""

        OmegaConf.resolve(config)
        manager = PluginManager.from_config(localized_hook_files(config), plugins)
        source = rollout_source(config, manager)
        try:
            trainer = build_trainer(config, train_samples, val_samples, manager, source)
            trainer.init_workers()
            manager.on_startup(config)  # redacted by the manager
            yield from trainer.steps()
        finally:
            source.close()


def rollout_source(config: DictConfig, manager: PluginManager) -> Any:
    """The run's rollout source: the gateway's, or a recording's with ``agentlightning.replay``."""
    from agl_core import ReplayRolloutSource, gateway_source

    if config.agentlightning.replay:
        from verl.utils.config import omega_conf_to_dataclass

        return ReplayRolloutSource(config, omega_conf_to_dataclass(config.actor_rollout_ref.model).tokenizer)
    return gateway_source(config, manager)


def build_trainer(
    config: DictConfig, train_samples: list, val_samples: list, manager: PluginManager, source: Any
) -> Any:
    """The :class:`~agl_backend_verl.trainer.AglRayPPOTrainer` for a resolved ``config``, with verl's
    worker classes and resource pools set up as verl's own task runner sets them (workers not started)."""
    from verl.trainer.main_ppo_v0 import BaseTaskRunner
    from verl.trainer.ppo.utils import create_rl_sampler, need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from agl_backend_verl.trainer import AglRayPPOTrainer, collate_samples

    cpu = cpu_mode.is_cpu(config)
    if cpu:
        cpu_mode.use_fp32(config)
    workers = BaseTaskRunner()
    _, worker_group_cls = workers.add_actor_rollout_worker(config)
    workers.add_critic_worker(config)
    workers.add_reward_model_resource_pool(config)
    workers.add_teacher_model_resource_pool(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    model = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    train = SampleDataset(train_samples, "train_dataset")
    return AglRayPPOTrainer(
        config=config,
        tokenizer=model.tokenizer,
        processor=model.processor,
        role_worker_mapping=workers.role_worker_mapping,
        resource_pool_manager=resource_pool_manager(workers, config, cpu),
        ray_worker_group_cls=worker_group_cls,
        train_dataset=train,
        val_dataset=SampleDataset(val_samples, "val_dataset"),
        collate_fn=collate_samples,
        train_sampler=create_rl_sampler(config.data, train),
        plugins=manager,
        rollout_source=source,
    )


def resource_pool_manager(workers: Any, config: DictConfig, cpu: bool) -> Any:
    """verl's resource pools for the run, checked against CPU rank slots in CPU mode."""
    manager = workers.init_resource_pool_mgr(config)
    if not cpu:
        return manager
    from agl_backend_verl.cpu.resources import CpuResourcePoolManager

    return CpuResourcePoolManager.like(manager)


RemoteTaskRunner = ray.remote(num_cpus=1)(TaskRunner)


class VerlBackend:
    """Backend ``verl`` for ``agl train``: the datasets are ``data.train_files`` / ``data.val_files`` (JSONL)."""

    def __init__(self, config: DictConfig, plugins: PluginManager):
        from agl_core import load_dataset

        if "ray_kwargs" not in config:
            raise ConfigError(
                "agentlightning.backend",
                "backend 'verl' needs the config built by agl_backend_verl.config.load_verl_config "
                "(agl train does this)",
            )
        self.config = config
        self.plugins = plugins
        self.train = load_dataset(config.data.train_files, "data.train_files")
        self.val = load_dataset(config.data.val_files, "data.val_files")

    def fit(self, on_step: OnStep | None = None) -> None:
        """Train; each step's metrics and samples come back from the Ray actor to ``on_step``. Hook
        files and entry points are loaded again there from the config; plugins given in code are sent."""
        run_ppo(self.config, self.train, self.val, plugins=self.plugins.given_in_code(), on_step=on_step)
