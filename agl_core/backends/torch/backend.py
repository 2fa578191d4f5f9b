"""The reference backend (``agentlightning.backend: torch``): one process, PyTorch, any local causal LM.

One training step, with every stage reached through the plugin registries:

rollouts (embedded source, or the gateway when ``agl_base_url`` is set) → Triplets → the configured
aggregator → the configured advantage estimator (on everything collected) → batch shaping → the
actor update (:mod:`agl_core.backends.torch.update`: tensors → old log-probs → PPO epochs of the
configured policy loss over mini-batches, AdamW) → lr schedule step → the serving copy of the
policy gets the new weights.

The steps run in the loop every backend shares (:mod:`agl_core.backends.loop`). Validation
(``data.val_files``): before the first step of a fresh run when ``trainer.val_before_train`` is set,
and after every ``trainer.test_freq``-th step and the last, one rollout per validation row
(``is_train=False``; the embedded source samples them at
``actor_rollout_ref.rollout.val_kwargs.temperature``, 0 = greedy), in batches of
``data.val_batch_size`` (all rows at once when unset); the ``val/*`` metrics are every backend's
(:func:`~agl_core.stages.pipeline.validation_metrics`), over every validation rollout of every batch
(Agent Lightning v1.0 keeps only the last batch's).

Async rollout (``agentlightning.async_rollout.enabled``; gateway only): a run's first step hands the
source enough batches to keep ``async_train_batch_size`` groups in flight, later steps one batch (the
source tops up and carries unfinished groups over); the gateway is paused and drained between the
rollouts and the update, and resumed once the new weights are registered. Every step reports the
staleness of the calls it trains (``training/async/staleness_*``, from the shared pipeline). A
checkpoint keeps what the source carries over (its groups in flight and waiting samples); a resumed
run restores it and hands its first step only what tops that up to ``async_train_batch_size``.

The policy is built as verl's model and engine keys say (:func:`build_policy`): its dtype
(:mod:`agl_core.backends.torch.precision`), gradient checkpointing, LoRA (:mod:`agl_core.backends.torch.lora`).

The policy is served by ``agentlightning.engine``: ``builtin`` (:class:`~agl_core.serving.policy_server.PolicyServer`,
in-process) or ``vllm`` (:class:`~agl_core.serving.vllm_engine.VllmEngine`). A vLLM server that dies
mid-step fails that step's rollouts (counted) and is restarted at the weight push
(``training/engine/n_restarts``). Checkpoints
(:mod:`agl_core.backends.torch.checkpoint`) hold model, optimizer, scheduler, step, data position, RNG states
and (async) the rollout source's groups in flight;
with ``trainer.resume_mode: auto`` a run continues from the newest one in ``trainer.default_local_dir``.
With ``agentlightning.torch.merged_model_dir`` the run ends by writing the policy there as a Hugging Face
model folder (a LoRA run's adapters merged in).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from agl_core.backends.contract import OnStep
from agl_core.backends.loop import LoopSettings, run_steps
from agl_core.backends.torch.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    restore_rng_states,
    rng_states,
    save_checkpoint,
)
from agl_core.backends.torch.data_order import DataOrder
from agl_core.backends.torch.lora import check_lora_keys, lora_enabled, with_lora
from agl_core.backends.torch.precision import Precision
from agl_core.backends.torch.update import ActorSettings, ActorUpdate, make_optimizer
from agl_core.config import ConfigError
from agl_core.data import CompletedRollout
from agl_core.datasets import load_dataset
from agl_core.serving.engine import InferenceEngine
from agl_core.serving.vllm_engine import VllmEngineError
from agl_core.serving.weights import is_adapted, save_served
from agl_core.stages.pipeline import StepPipeline, validation_metrics

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_core.plugins import PluginManager
    from agl_core.rollouts.source import RolloutSource

__all__ = ["TorchBackend", "build_policy", "check_torch_config", "model_folder", "pick_device"]

logger = logging.getLogger(__name__)


def model_folder(config: DictConfig) -> Path:
    path = config.actor_rollout_ref.model.path
    key = "actor_rollout_ref.model.path"
    if not path:
        raise ConfigError(key, "the policy's model folder is not set")
    folder = Path(path)
    if not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "has no config.json"
        raise ConfigError(key, f"model folder {path} {what} (a local Hugging Face causal LM folder is needed)")
    return folder


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("agentlightning.torch.device", f"{name} was asked for, but no CUDA device is available")
    return torch.device(name)


def load_policy(
    folder: Path, device: torch.device, *, frozen: bool = False, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The causal LM in ``folder`` in ``dtype`` on ``device``; ``frozen``: in eval mode, without gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    if frozen:
        model.eval().requires_grad_(False)
    return model


def build_policy(
    config: DictConfig, folder: Path, device: torch.device, dtype: torch.dtype
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The policy to train and its reference (``actor.use_kl_loss``; else ``None``) as
    ``actor_rollout_ref.model`` says: gradient checkpointing (``enable_gradient_checkpointing``), LoRA
    (``lora_rank`` > 0; the reference is then the policy itself with its adapters disabled), else a
    frozen second copy for the reference."""
    model_cfg = config.actor_rollout_ref.model
    check_lora_keys(model_cfg)
    model = load_policy(folder, device, dtype=dtype)
    if model_cfg.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_enabled(model_cfg):
        model = with_lora(model, model_cfg)
    if not config.actor_rollout_ref.actor.use_kl_loss:
        return model, None
    return model, model if is_adapted(model) else load_policy(folder, device, frozen=True, dtype=dtype)


class TorchBackend:
    """The reference backend; ``fit(on_step)`` trains until the configured number of steps."""

    engine: InferenceEngine
    """Serves the policy to the agents; made and started by :meth:`fit`."""
    source: RolloutSource
    """Runs the agents; made by :meth:`fit` once the engine serves the first weights."""

    def __init__(self, config: DictConfig, plugins: PluginManager):
        from transformers import AutoTokenizer

        self.config, self.plugins = config, plugins
        actor = config.actor_rollout_ref.actor
        loss_fn = plugins.policy_losses.get(actor.policy_loss.loss_mode)
        folder = model_folder(config)
        if config.agentlightning.async_rollout.enabled and not config.agentlightning.agl_base_url:
            raise ConfigError(
                "agentlightning.async_rollout.enabled",
                "async rollout runs through the gateway: set agentlightning.agl_base_url"
                " (the embedded source is sync only)",
            )
        self.data = DataOrder.from_config(config)
        steps = config.trainer.total_training_steps
        self.total_steps = int(steps if steps is not None else config.trainer.total_epochs * self.data.steps_per_epoch)
        self.val_rows = load_dataset(config.data.val_files, "data.val_files") if config.data.val_files else []
        self.loop = LoopSettings.from_config(config, self.total_steps, has_validation=bool(self.val_rows))
        if config.agentlightning.torch.num_threads:
            torch.set_num_threads(int(config.agentlightning.torch.num_threads))
        torch.manual_seed(int(config.trainer.seed))
        device = pick_device(config.agentlightning.torch.device)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.pad_token_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        settings = ActorSettings.from_config(config.actor_rollout_ref, config.agentlightning.torch.share_prefixes)
        self.model, ref_model = build_policy(config, folder, device, settings.precision.param_dtype)
        self.optimizer, self.scheduler = make_optimizer(self.model, actor.optim, self.total_steps)
        self.actor_update = ActorUpdate(
            self.model, ref_model, self.optimizer, loss_fn, settings, device, self.pad_token_id
        )
        self.pipeline = StepPipeline(config, plugins, self.tokenizer)
        self.run_dir = Path(config.trainer.default_local_dir)
        self.step = 0
        self._sampler_state: object | None = None
        self._source_state: Mapping[str, Any] | None = None

    # -- serving --------------------------------------------------------------------------------

    def make_engine(self) -> InferenceEngine:
        name = str(self.config.actor_rollout_ref.model.path)
        if self.config.agentlightning.engine == "vllm":
            from agl_core.serving.vllm_engine import VllmEngine

            return VllmEngine.from_config(
                self.config.agentlightning.vllm, self.config.actor_rollout_ref.model.path, name
            )
        from agl_core.serving.policy_server import PolicyServer

        return PolicyServer(self.model, self.tokenizer, name, seed=int(self.config.trainer.seed))

    def make_source(self) -> RolloutSource:
        if self.config.agentlightning.replay:
            from agl_core.rollouts.replay import ReplayRolloutSource

            return ReplayRolloutSource(self.config, self.tokenizer)
        if self.config.agentlightning.agl_base_url:
            from agl_core.rollouts.gateway import gateway_source

            return gateway_source(self.config, self.plugins)
        from agl_core.rollouts.embedded import EmbeddedRolloutSource

        return EmbeddedRolloutSource(self.config, self.plugins, self.engine.base_url, self.engine.model_name)

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self) -> None:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": self.data.position(),
            "rng": rng_states(),
        }
        sampler = self.engine.sampler_state()
        if sampler is not None:
            state["sampler_rng"] = sampler
        in_flight = self.source.state()
        if in_flight is not None:
            state["rollout_source"] = in_flight
        save_checkpoint(self.run_dir, self.step, self.model, self.tokenizer, state)

    def resume(self) -> bool:
        """Continue from the newest checkpoint when ``trainer.resume_mode`` is ``auto``."""
        if self.config.trainer.resume_mode != "auto":
            return False
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return False
        state = load_checkpoint(path, self.model)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.data.restore(state["data"])
        restore_rng_states(state["rng"])
        self.step = int(state["step"])
        self._sampler_state = state.get("sampler_rng")
        self._source_state = state.get("rollout_source")
        logger.info("resumed from %s (step %d)", path, self.step)
        return True

    # -- training -------------------------------------------------------------------------------

    def fit(self, on_step: OnStep | None = None) -> None:
        self.resume()
        self.engine = self.make_engine()
        try:
            self.engine.start()
            self.engine.push_weights(self.model, self.step)
            if self._sampler_state is not None:
                self.engine.restore_sampler_state(self._sampler_state)
            self.plugins.on_startup(self.config)
            self.source = self.make_source()
            self.source.on_rollout_done = self.pipeline.prepare_rollout
            try:
                self.source.after_weight_update([self.engine.base_url], self.step)
                loop = self.loop
                if self._source_state is not None:
                    carried = self.source.restore(self._source_state)
                    loop = attrs.evolve(loop, fill=max(0, loop.fill - carried))  # the fill counts what is carried
                for step, total, metrics in run_steps(self, loop):
                    if on_step is not None:
                        on_step(step, total, metrics, self.pipeline.take_samples())
                self.export_merged()
            finally:
                self.source.close()
        finally:
            self.engine.close()

    def export_merged(self) -> None:
        """Write the policy (a LoRA run's adapters merged in) to ``agentlightning.torch.merged_model_dir``, if set."""
        folder = self.config.agentlightning.torch.merged_model_dir
        if folder:
            save_served(self.model, folder)
            self.tokenizer.save_pretrained(folder)
            logger.info("wrote the merged policy to %s", folder)

    def next_batch(self) -> list[Mapping[str, Any]]:
        return self.data.next_batch()

    def validate(self) -> dict[str, float]:
        """One rollout per validation row with the current weights; ``val/*`` metrics over all batches
        (:func:`~agl_core.stages.pipeline.validation_metrics`)."""
        size = int(self.config.data.val_batch_size or len(self.val_rows))
        rollouts: list[CompletedRollout] = []
        source_metrics: list[dict[str, float]] = []
        for start in range(0, len(self.val_rows), size):
            batch = self.source.collect(self.val_rows[start : start + size], step=self.step, is_train=False)
            rollouts.extend(batch.rollouts)
            source_metrics.append(batch.metrics)
        return validation_metrics(rollouts, source_metrics)

    def train_step(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Train step ``step + 1`` on ``samples`` and advance ``step``."""
        self.step += 1
        step = self.step
        started = time.perf_counter()
        batch = self.source.collect(samples, step=step, is_train=True)
        metrics: dict[str, float] = dict(batch.metrics)
        metrics["timing/gen_s"] = time.perf_counter() - started
        metrics.update(self.source.before_weight_update())  # async: pause the gateway, drain in-flight calls
        update_started = time.perf_counter()
        metrics.update(self.learn(batch.rollouts, step))
        metrics.update(self.serve_weights(step))
        metrics["timing/update_s"] = time.perf_counter() - update_started
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.data.epoch)
        return metrics

    def learn(self, rollouts: Sequence[CompletedRollout], step: int) -> dict[str, float]:
        """The shared pipeline on ``rollouts``, the actor update and the lr schedule's step: step
        ``step`` from the rollouts on."""
        prepared = self.pipeline.prepare(rollouts, step)
        metrics = dict(prepared.metrics)
        if prepared.shaped is not None:
            update = self.actor_update(prepared)
            metrics.update(update)
            metrics["actor/lr"] = float(self.scheduler.get_last_lr()[0])
            if update["actor/n_updates"] > update.get("actor/n_skipped_nonfinite_grad", 0.0):
                self.scheduler.step()  # the schedule advances with the optimizer only
        return metrics

    def replay_step(self, rollouts: Sequence[CompletedRollout], step: int) -> dict[str, float]:
        """Re-run step ``step`` of this run on its recorded ``rollouts`` (``agl replay``): from the
        checkpoint of step ``step - 1`` in the run directory when there is one, else the initial
        model; no engine or rollout source is started."""
        checkpoint = self.run_dir / f"global_step_{step - 1}"
        if step > 1 and checkpoint.is_dir():
            state = load_checkpoint(checkpoint, self.model)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            logger.info("replaying step %d from %s", step, checkpoint)
        else:
            logger.info("replaying step %d from the initial model (no checkpoint %s)", step, checkpoint)
        self.step = step
        return self.learn(rollouts, step)

    def serve_weights(self, version: int) -> dict[str, float]:
        """Push the weights and register the engine with ``version``. A vLLM server that died (its
        rollouts this step failed and were counted) is started again (an attached one: waited for,
        up to ``agentlightning.vllm.startup_timeout_seconds``) and pushed to once more; a second
        failure ends training."""
        restarts = 0
        try:
            self.engine.push_weights(self.model, version)
        except VllmEngineError as exc:
            logger.warning("weight push failed, restarting the vLLM engine: %s", exc)
            self.engine.start()
            self.engine.push_weights(self.model, version)
            restarts = 1
        self.source.after_weight_update([self.engine.base_url], version)
        return {"training/engine/n_restarts": float(restarts)}


def check_torch_config(config: DictConfig) -> None:
    """What ``agl check`` verifies without loading the model: the model folder, the device, the lr
    schedule and, for the embedded source, that the agent class imports."""
    from agl_core.backends.torch.update import lr_lambda

    model_folder(config)
    pick_device(config.agentlightning.torch.device)
    check_lora_keys(config.actor_rollout_ref.model)
    Precision.from_config(config.actor_rollout_ref.actor.fsdp_config)
    lr_lambda(config.actor_rollout_ref.actor.optim, 1)
    if not config.agentlightning.agl_base_url and not config.agentlightning.replay:
        from agl_core.rollouts.agents import load_agent_class

        load_agent_class(config.agentlightning.local.agent_class)
