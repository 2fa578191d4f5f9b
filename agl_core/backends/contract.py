"""What a training backend gives ``agl train``: the objects ``agl_register_backends`` registers.

A plugin registers either a :class:`BackendSpec` (a factory and the config loader its runs are
validated with) or a bare :data:`BackendFactory`, which stands for ``BackendSpec(factory)``: its runs
are validated against the core schema (:func:`agl_core.config.load_config`). The factory returns a
:class:`Backend`, in one of two ways:

- **agl runs the loop** (the usual case): a subclass of
  :class:`~agl_core.backends.loop_backend.LoopBackend`, which implements ``fit`` with agl's step loop
  (startup, the step, validation, checkpoints, resume, the step metrics) and asks the backend only
  for its update, serving its weights and its checkpoint files. The class itself is the factory.
- **the engine runs the loop**: a backend that hands the loop to its engine (verl's trainer owns
  validation, the step and checkpoints) implements ``fit(on_step)`` itself and still reports the same
  metric names through ``on_step``, built from the loop's parts:
  :func:`~agl_core.backends.rollout_source.open_rollout_source`,
  :class:`~agl_core.stages.pipeline.StepPipeline`, :func:`~agl_core.stages.pipeline.validation_metrics`,
  :func:`~agl_core.backends.checkpoints.save_source_state` /
  :func:`~agl_core.backends.checkpoints.restore_source_state`, ``plugins.on_startup`` and
  ``plugins.on_weights_served``. :class:`agl_core.testing.contracts.BackendContract` checks either
  kind the same way (its docstring lists what a loop-owning backend must provide).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import attrs
from omegaconf import OmegaConf

from agl_core.config import ConfigError, load_config

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_core.config import ConfigFile
    from agl_core.data import StepSamples
    from agl_core.plugins import PluginManager
    from agl_core.plugins.registry import RegistryEntry

__all__ = [
    "PLAIN_UPDATE_KEYS",
    "Backend",
    "BackendFactory",
    "BackendSpec",
    "ConfigCheck",
    "ConfigLoader",
    "OnStep",
    "backend_spec",
    "check_plain_update",
    "check_text_policy",
]

PLAIN_UPDATE_KEYS: Mapping[str, Any] = MappingProxyType(
    {
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.use_dynamic_bsz": False,
        "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
        "actor_rollout_ref.actor.fsdp_config.model_dtype": "fp32",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision": None,
        "actor_rollout_ref.model.lora_rank": 0,
        "actor_rollout_ref.model.enable_gradient_checkpointing": False,
        "agentlightning.engine": "builtin",
    }
)
"""The values of a backend whose update is the plain one of :mod:`agl_core.backends.ppo` (no reference
policy, one pass per mini-batch, a constant learning rate, float32, every weight trained, agl's own
engine); every other value needs what the torch backend adds to it (:func:`check_plain_update`)."""


def check_plain_update(config: DictConfig, backend: str) -> None:
    """Refuse, naming the key, a value of :data:`PLAIN_UPDATE_KEYS` (or a learning-rate warmup, or a
    vision-language policy) that ``backend``, a backend with the plain update, does not implement: its
    ``check_config``."""
    for key, value in PLAIN_UPDATE_KEYS.items():
        if OmegaConf.select(config, key) != value:
            raise ConfigError(key, f"backend {backend!r} trains with {value!r} only; the torch backend has the others")
    if int(config.actor_rollout_ref.actor.optim.lr_warmup_steps) > 0:
        raise ConfigError("actor_rollout_ref.actor.optim.lr_warmup_steps", f"backend {backend!r} has no lr warmup")
    check_text_policy(config, backend)


def check_text_policy(config: DictConfig, backend: str) -> None:
    """Refuse a vision-language policy (a model folder with an image processor) for ``backend``, whose
    rows would otherwise reach the model without their images."""
    from agl_core.serving.models import is_vision_policy

    folder = config.actor_rollout_ref.model.path
    if folder is not None and is_vision_policy(str(folder)):
        raise ConfigError(
            "actor_rollout_ref.model.path",
            f"{folder} is a vision-language model; backend {backend!r} trains text models only (the torch "
            "backend trains vision-language ones)",
        )


OnStep = Callable[[int, int, Mapping[str, float], "StepSamples"], None]
"""``on_step(step, total_steps, metrics, samples)``: called after every training step with the step's
metrics (name → float) and sample tables (:data:`~agl_core.data.StepSamples`: the pipeline's
``trajectories`` and ``mismatches``, ``{}`` when there are none); a validation before the first step
is reported as step 0. ``agl train``'s ``on_step`` also takes the call without ``samples``, from a
backend that has none."""


class Backend(Protocol):
    __module__ = "agl_core"

    def fit(self, on_step: OnStep | None = None) -> None:
        """Train until the configured number of steps (continuing from a checkpoint where the
        config says so), calling ``on_step`` after every step. Before its first rollout it calls
        ``plugins.on_startup(config)`` once, and after every weight push
        ``plugins.on_weights_served(endpoints, version)``, in the process where the rollout hooks run."""


BackendFactory = Callable[["DictConfig", "PluginManager"], Backend]
"""``factory(config, plugins)``: a backend for the validated run config and the run's plugin manager."""

ConfigLoader = Callable[["str | ConfigFile | None", Sequence[str]], "DictConfig"]
"""``load(source, overrides)``: the validated run config from a YAML file (its path, or the
:class:`~agl_core.config.ConfigFile` ``agl train`` already read; :func:`~agl_core.config.merge_config`
takes either) and ``key=value`` overrides; bad input raises :class:`~agl_core.config.ConfigError`
naming the key."""


ConfigCheck = Callable[["DictConfig"], None]
"""``check(config)``: what the backend needs before it trains (files, devices, services), checked
without loading a model; bad input raises :class:`~agl_core.config.ConfigError` naming the key."""


def _no_estimators() -> frozenset[str]:
    return frozenset()


@attrs.frozen
class BackendSpec:
    """A backend as registered: its factory, the loader that validates its runs (a backend whose
    schema is larger than the core's, like verl's, brings its own), the check ``agl check`` runs,
    and the advantage estimators the backend computes itself (verl's ``gae``,
    ``reinforce_plus_plus``...: ``algorithm.adv_estimator`` may name them without an agl plugin)."""

    factory: BackendFactory
    load_config: ConfigLoader = load_config
    check_config: ConfigCheck | None = None
    native_estimators: Callable[[], frozenset[str]] = _no_estimators

    def __call__(self, config: DictConfig, plugins: PluginManager) -> Backend:
        """Build the backend (a spec is called like the factory it holds)."""
        return self.factory(config, plugins)


def backend_spec(entry: RegistryEntry) -> BackendSpec:
    """The :class:`BackendSpec` of a backends registry entry (a bare factory stands for ``BackendSpec(factory)``)."""
    return entry.obj if isinstance(entry.obj, BackendSpec) else BackendSpec(entry.obj)
