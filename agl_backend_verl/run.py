"""Entry points: :func:`run_ppo` for in-memory datasets, and :class:`VerlBackend` for ``agl train``.

Both start Ray when nobody has (verl's PPO runtime env + ``ray_kwargs.ray_init`` + this package in
``VERL_USE_EXTERNAL_MODULES``), then run :class:`TaskRunner` as a Ray actor on the node ``agl train``
runs on (so the dataset files and hook files it names are the ones the driver sees). The actor does
what verl's V1 task runner does — TransferQueue started, the trainer of ``trainer.v1.trainer_mode``
built (:func:`~agl_backend_verl.trainer.trainer_class`) and initialised, its agent-loop manager
created, ``fit`` — with agl's pieces in verl's slots: the dataset (``data.custom_cls``), the
agent-loop manager (:class:`~agl_backend_verl.agent_loop.RolloutLoopManager` over the run's rollout
source) and the trainer's step. The actor streams each step's ``(step, total_steps, metrics,
samples)`` back to the driver as verl's loop logs it (a Ray streaming generator), where ``on_step``
sees them: ``agl train``'s metric sinks run there.

The rollout hooks run in the actor, so that is where the run's plugins live: hook files and entry
points are loaded again there from the config, and plugins given in code are pickled and sent with
the call (one that cannot be pickled is refused before Ray starts). ``agl_on_startup`` runs once,
in the actor, with the config's secrets redacted.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf, open_dict

from agl_backend_verl.config import (
    AGL_AGENT_LOOP_MANAGER,
    check_verl_requirements,
    load_verl_config_mapping,
    trainer_mode,
    warmup_batches,
)
from agl_backend_verl.cpu import mode as cpu_mode
from agl_backend_verl.dataset import DATASET_SLOT
from agl_backend_verl.dropout import turn_off_dropout
from agl_backend_verl.ray_cluster import start_or_join
from agl_backend_verl.ray_errors import nodes_watched, ray_failures_explained
from agl_backend_verl.shipping import absolute_paths, localized_hook_files, shipped_runtime_env
from agl_backend_verl.trainer import StepReport
from agl_backend_verl.verl_plugins import plugin_settings_env, ray_runtime_env
from agl_core import (
    ConfigError,
    OnStep,
    PluginError,
    PluginManager,
    open_rollout_source,
    read_recording,
    write_dataset,
)
from agl_core import run_ppo as core_run_ppo


def ray_init_kwargs(config: DictConfig) -> dict[str, Any]:
    """The arguments :func:`init_ray` gives ``ray.init``: ``ray_kwargs.ray_init`` with verl's PPO
    runtime env under the user's, agl's module added to the workers' verl imports, the plugin
    settings given to the workers (:func:`~agl_backend_verl.verl_plugins.plugin_settings_env`) and
    TransferQueue switched on (verl's V1 trainer runs on it)."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    ray_init = OmegaConf.to_container(config.ray_kwargs.get("ray_init", {}), resolve=True) or {}
    assert isinstance(ray_init, dict)
    runtime_env = {**get_ppo_ray_runtime_env(config), **(ray_init.pop("runtime_env", None) or {})}
    kwargs = {"runtime_env": ray_runtime_env(runtime_env), **{k: v for k, v in ray_init.items() if v is not None}}
    kwargs["runtime_env"]["env_vars"].update(plugin_settings_env(config))
    kwargs["runtime_env"]["env_vars"]["TRANSFER_QUEUE_ENABLE"] = "1"
    kwargs["runtime_env"] = shipped_runtime_env(config, kwargs["runtime_env"])
    if cpu_mode.is_cpu(config):
        kwargs["runtime_env"]["env_vars"].update(cpu_mode.runtime_env_vars())
        kwargs = cpu_mode.ray_init_kwargs(config, kwargs)
    return kwargs


def init_ray(config: DictConfig) -> None:
    """Start Ray as verl's ``run_ppo`` does (:func:`ray_init_kwargs`), unless it is running."""
    if ray.is_initialized():
        return  # the verl.plugins entry point registers agl's plugins in workers of any Ray session
    start_or_join(ray_init_kwargs(config), float(config.agentlightning.verl.ray_connect_timeout_seconds))


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
    config: Mapping[str, Any] | DictConfig,
    train_dataset: Sequence[Mapping[str, Any]],
    val_dataset: Sequence[Mapping[str, Any]] | None = None,
    plugins: Sequence[Any] = (),
    on_step: OnStep | None = None,
) -> Path | None:
    """Train with verl on in-memory datasets, as Agent Lightning v1.0's
    ``agentlightning.verl.entrypoint.run_ppo`` does: a script changes only that import.

    ``config`` is the dict or ``DictConfig`` the script builds (Hydra's compose of its verl config
    included), loaded as a file would be (:func:`~agl_backend_verl.config.load_verl_config_mapping`:
    agl's own keys take their defaults, a bad key is refused by name before Ray starts); the
    datasets are lists of JSON-like dicts, each a rollout ``input``. Without ``on_step`` this is
    :func:`agl_core.run_ppo` on backend ``verl``: the datasets are written to the run directory and
    each step is logged to the run log and the ``trainer.logger`` sinks, as ``agl train`` logs it;
    the run directory is returned. With ``on_step(step, total_steps, metrics, samples)`` the caller
    gets every step instead (step 0: validation before training) and the datasets live in a
    temporary folder. ``plugins`` run in the Ray actor, as copies: they must pickle (:func:`shippable`)."""
    shippable(plugins)
    if on_step is None:
        return core_run_ppo(
            config, train_dataset, val_dataset, overrides=["agentlightning.backend=verl"], plugins=plugins
        )
    loaded = load_verl_config_mapping(config)
    with tempfile.TemporaryDirectory(prefix="agl-verl-data-") as folder:
        files = {"train_files": str(write_dataset(train_dataset, Path(folder) / "train.jsonl", "train_dataset"))}
        if val_dataset is not None:
            files["val_files"] = str(write_dataset(val_dataset, Path(folder) / "val.jsonl", "val_dataset"))
        train(OmegaConf.merge(loaded, {"data": files}), plugins, on_step)
    return None


def train(config: DictConfig, plugins: Sequence[Any] = (), on_step: OnStep | None = None) -> None:
    """Train on the dataset files ``data.train_files`` / ``data.val_files`` (see the module docstring)."""
    plugins = shippable(plugins)
    check_verl_requirements(config)
    if cpu_mode.is_cpu(config):
        from verl.trainer.ppo.utils import need_critic

        cpu_mode.check_cpu_config(config, use_critic=need_critic(config))
    config = absolute_paths(config)
    with ray_failures_explained():
        init_ray(config)
        check_gpus(config)
        here = ray.get_runtime_context().get_node_id()
        runner = RemoteTaskRunner.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(here, soft=False)
        ).remote()
        with nodes_watched():
            for step, total, metrics, samples in actor_steps(runner, config, plugins):
                if on_step is not None:
                    on_step(step, total, metrics, samples)


def actor_steps(runner: Any, config: DictConfig, plugins: list) -> Iterator[StepReport]:
    """Run ``runner.run`` (a :class:`TaskRunner` actor) and yield each step it streams as soon as it
    arrives; an error in the actor is raised here."""
    for ref in runner.run.options(num_returns="streaming").remote(config, plugins):
        yield ray.get(ref)


def v1_config(config: DictConfig) -> DictConfig:
    """``config`` with verl's slots set to agl's: the dataset class, the agent-loop manager, the
    trainer mode (Agent Lightning's async rollout is ``colocate_async``) and its warm-up batches,
    TransferQueue on, no tracker of verl's own (``trainer.logger`` names agl's sinks, which run in
    ``agl train``), and the models' dropout off (:func:`~agl_backend_verl.dropout.turn_off_dropout`).
    Without ``data.val_files`` nothing is validated."""
    mode = trainer_mode(config)
    turn_off_dropout(config)
    with open_dict(config):
        if not config.data.val_files:  # no validation: verl's loop still builds a dataset, never read
            config.data.val_files = config.data.train_files
            config.trainer.test_freq, config.trainer.val_before_train = -1, False
        config.trainer.logger = []
        config.data.custom_cls = dict(DATASET_SLOT)
        config.actor_rollout_ref.rollout.agent.agent_loop_manager_class = AGL_AGENT_LOOP_MANAGER
        config.trainer.v1.trainer_mode = mode
        if mode != "sync":
            config.trainer.v1[mode].num_warmup_batches = warmup_batches(config)
        config.transfer_queue.enable = True
    return config


class TaskRunner:
    """Runs verl's V1 trainer with agl's pieces, inside the Ray cluster (as verl's task runner)."""

    def run(self, config: DictConfig, plugins: list) -> Iterator[StepReport]:
        """Train, yielding ``(step, total_steps, metrics, samples)`` after each step."""
        import transfer_queue as tq

        from agl_backend_verl.agent_loop import RolloutLoopManager
        from agl_backend_verl.trainer import trainer_class

        OmegaConf.resolve(config)
        config = v1_config(config)
        if cpu_mode.is_cpu(config):
            cpu_mode.use_fp32(config)
        manager = PluginManager.from_config(localized_hook_files(config), plugins)
        tq.init(config.transfer_queue)
        loop = None
        try:
            trainer = trainer_class(config.trainer.v1.trainer_mode)(config, plugins=manager)
            trainer.init()
            if trainer.global_steps > 0 and not config.trainer.val_only:
                config.trainer.val_before_train = False  # agl validates first on a fresh run only
            manager.on_startup(config)  # redacted by the manager
            loop = RolloutLoopManager.create(
                source=rollout_source(config, manager, trainer), n=int(config.actor_rollout_ref.rollout.n)
            )
            yield from fit_reports(trainer, loop)
        finally:
            if loop is not None:
                loop.close()
            tq.close()


def fit_reports(trainer: Any, loop: Any) -> Iterator[StepReport]:
    """Run ``trainer.fit(loop)`` in a thread and yield what it reports as it reports it; its error,
    if it fails, is raised here after the reports made before it."""
    failure: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit(loop)
        except BaseException as exc:
            failure.append(exc)
        finally:
            trainer.reports.put(None)

    thread = threading.Thread(target=fit, name="verl-fit", daemon=True)
    thread.start()
    while (report := trainer.reports.get()) is not None:
        yield report
    thread.join()
    if failure:
        raise failure[0]


def rollout_source(config: DictConfig, manager: PluginManager, trainer: Any) -> Any:
    """The run's rollout source (:func:`~agl_core.open_rollout_source`: a recording, the gateway, or
    the embedded agents calling the first replica); in the async modes the gateway's async source,
    which pauses and drains the gateway around each weight update."""
    agl = config.agentlightning
    if agl.agl_base_url and not agl.replay:
        async_rollout = {"enabled": config.trainer.v1.trainer_mode != "sync"}
        if agl.async_rollout.async_train_batch_size is None:  # verl's replay buffer keeps the groups in flight
            async_rollout["async_train_batch_size"] = 2 * int(config.data.train_batch_size)
        config = OmegaConf.merge(config, {"agentlightning": {"async_rollout": async_rollout}})
    return open_rollout_source(config, manager, trainer.tokenizer, trainer.serving_endpoints())


RemoteTaskRunner = ray.remote(num_cpus=1)(TaskRunner)


class VerlBackend:
    """Backend ``verl`` for ``agl train``: the datasets are ``data.train_files`` / ``data.val_files``."""

    def __init__(self, config: DictConfig, plugins: PluginManager):
        if "ray_kwargs" not in config:
            raise ConfigError(
                "agentlightning.backend",
                "backend 'verl' needs the config built by agl_backend_verl.config.load_verl_config "
                "(agl train does this)",
            )
        self.config = config
        self.plugins = plugins

    def fit(self, on_step: OnStep | None = None) -> None:
        """Train; each step's metrics and samples come back from the Ray actor to ``on_step``. Hook
        files and entry points are loaded again there from the config; plugins given in code are sent."""
        train(self.config, plugins=self.plugins.given_in_code(), on_step=on_step)

    def replay_step(self, rollouts: Sequence[Any], step: int) -> dict[str, float]:
        """Re-run step ``step`` of the recording at ``agentlightning.replay`` through verl's trainer
        (``agl replay``): from verl's checkpoint of step ``step - 1`` in ``trainer.default_local_dir``
        when there is one, else from the initial model (on a copy of the recording holding that step
        alone, as step 1); nothing is validated, checkpointed or written to the run. ``rollouts`` are
        the step's, which the trainer reads from the recording itself. Returns the step's metrics."""
        run_dir = Path(self.config.trainer.default_local_dir)
        checkpoint = run_dir / f"global_step_{step - 1}"
        with tempfile.TemporaryDirectory(prefix="agl-verl-replay-") as scratch:
            trainer = {"save_freq": -1, "test_freq": -1, "val_before_train": False, "default_local_dir": scratch}
            replayed: dict[str, Any] = {}
            if step > 1 and checkpoint.is_dir():
                trainer.update(resume_mode="resume_path", resume_from_path=str(checkpoint), total_training_steps=step)
            else:
                trainer.update(resume_mode="disable", total_training_steps=1)
                copy = read_recording(self.config.agentlightning.replay).save_step(step, Path(scratch) / "step.jsonl")
                replayed = {"agentlightning": {"replay": str(copy)}}
            config = OmegaConf.merge(self.config, {"trainer": trainer}, replayed)
            reports: dict[int, dict[str, float]] = {}
            train(
                config,
                self.plugins.given_in_code(),
                lambda s, total, metrics, samples=None: reports.update({s: metrics}),
            )
        return reports[max(reports)]
