"""The reference backend (``agentlightning.backend: torch``): one process, PyTorch, any local causal LM.

It is a :class:`~agl_core.backends.loop_backend.LoopBackend`: the step loop (startup, rollouts,
the step pipeline, validation, checkpoints, resume, metrics) is agl's, and this module supplies what
the loop asks of a backend. Its update (:mod:`agl_core.backends.torch.update`): tensors → old (and
reference) log-probs → PPO epochs of the configured policy loss over the mini-batches, AdamW → the
lr schedule's step. Its serving: ``agentlightning.engine`` ``builtin``
(:class:`~agl_core.serving.policy_server.PolicyServer`, in-process, a copy of the policy) or
``vllm`` (:class:`~agl_core.serving.vllm_engine.VllmEngine`); a vLLM server that dies mid-step
fails that step's rollouts (counted) and is restarted at the weight push
(``training/engine/n_restarts``). Its checkpoint files: the policy (or a LoRA run's adapter,
:mod:`agl_core.backends.torch.checkpoint`), with the optimizer, lr schedule and the engine's sampler
state in the loop's ``trainer_state.pt``.

The embedded source samples validation rollouts at ``actor_rollout_ref.rollout.val_kwargs.temperature``
(0 = greedy). Async rollout (``agentlightning.async_rollout.enabled``) runs through the gateway only.

The policy is built as verl's model and engine keys say (:func:`build_policy`): its dtype
(:mod:`agl_core.backends.precision`), gradient checkpointing, LoRA (:mod:`agl_core.backends.lora`).
With ``agentlightning.torch.merged_model_dir`` the run ends by writing the policy there as a Hugging Face
model folder (a LoRA run's adapters merged in).

A vision-language policy (a model folder with an image processor, ``preprocessor_config.json``) is
loaded as an image-text-to-text model and trained on rows with images (mrope positions and image
inputs, :mod:`agl_core.stages.vision`); the builtin engine serves it text only and refuses image
requests, so its rollouts come from a gateway in front of vLLM, or from a recording.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agl_core.backends.contract import OnStep
from agl_core.backends.dropout import load_update_model
from agl_core.backends.loop_backend import LoopBackend, Served
from agl_core.backends.lora import check_lora_keys, lora_enabled, with_lora
from agl_core.backends.ppo import lr_schedule, make_optimizer
from agl_core.backends.torch.checkpoint import ADAPTER_DIR, MODEL_DIR, load_weights, save_weights
from agl_core.backends.torch.checks import check_device, model_folder
from agl_core.backends.torch.update import ActorSettings, ActorUpdate
from agl_core.serving.engine import InferenceEngine
from agl_core.serving.models import IMAGE_PROCESSOR_FILE, is_vision_policy, load_policy_model
from agl_core.serving.vllm_engine import VllmEngineError
from agl_core.serving.weights import is_adapted, save_served
from agl_core.stages.pipeline import PreparedBatch

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_core.plugins import PluginManager

__all__ = ["TorchBackend", "build_policy", "pick_device"]

logger = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device(name)
    return torch.device(name)


def load_policy(
    folder: Path, device: torch.device, *, frozen: bool = False, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The causal LM (or vision-language model) in ``folder`` in ``dtype`` on ``device``; ``frozen``: in
    eval mode, without gradients."""
    model = load_policy_model(folder, dtype=dtype).to(device)
    if frozen:
        model.eval().requires_grad_(False)
    return model


def build_policy(
    config: DictConfig, folder: Path, device: torch.device, dtype: torch.dtype
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The policy to train and its reference (``actor.use_kl_loss``; else ``None``) as
    ``actor_rollout_ref.model`` says: gradient checkpointing (``enable_gradient_checkpointing``), LoRA
    (``lora_rank`` > 0; the reference is then the policy itself with its adapters disabled), else a
    frozen second copy for the reference; the policy's dropout off unless ``agentlightning.disable_dropout``
    is false (:func:`~agl_core.backends.dropout.load_update_model`)."""
    model_cfg = config.actor_rollout_ref.model
    check_lora_keys(model_cfg)
    disable_dropout = bool(config.agentlightning.disable_dropout)
    model = load_update_model(folder, disable_dropout=disable_dropout, dtype=dtype, device=device)
    if model_cfg.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_enabled(model_cfg):
        model = with_lora(model, model_cfg)
    if not config.actor_rollout_ref.actor.use_kl_loss:
        return model, None
    return model, model if is_adapted(model) else load_policy(folder, device, frozen=True, dtype=dtype)


class TorchBackend(LoopBackend):
    """The reference backend: the policy trained in this process (:class:`ActorUpdate`) and served
    by ``agentlightning.engine``; :meth:`~agl_core.backends.loop_backend.LoopBackend.fit` trains."""

    engine: InferenceEngine | None
    """Serves the policy to the agents; made and started by the first :meth:`serve`."""

    def __init__(self, config: DictConfig, plugins: PluginManager):
        from transformers import AutoTokenizer

        actor = config.actor_rollout_ref.actor
        loss_fn = plugins.policy_losses.get(actor.policy_loss.loss_mode)
        folder = model_folder(config)
        super().__init__(config, plugins, AutoTokenizer.from_pretrained(folder))
        if config.agentlightning.torch.num_threads:
            torch.set_num_threads(int(config.agentlightning.torch.num_threads))
        torch.manual_seed(int(config.trainer.seed))
        device = pick_device(config.agentlightning.torch.device)
        self.pad_token_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        torch_config = config.agentlightning.torch
        settings = ActorSettings.from_config(
            config.actor_rollout_ref, torch_config.share_prefixes, torch_config.max_tree_tokens
        )
        self.model, ref_model = build_policy(config, folder, device, settings.precision.param_dtype)
        self.optimizer = make_optimizer(self.model, actor.optim)
        self.scheduler = lr_schedule(self.optimizer, actor.optim, self.total_steps)
        self.vision = None
        if is_vision_policy(folder):
            from agl_core.stages.vision import VisionSpec

            self.vision = VisionSpec.from_pretrained(folder)
        self.actor_update = ActorUpdate(
            self.model,
            ref_model,
            self.optimizer,
            loss_fn,
            settings,
            device,
            self.pad_token_id,
            self.vision,
            self.scheduler,
        )
        self.model_folder = folder
        self.engine = None
        self._sampler_state: object | None = None

    def make_engine(self) -> InferenceEngine:
        name = str(self.config.actor_rollout_ref.model.path)
        if self.config.agentlightning.engine == "vllm":
            from agl_core.serving.vllm_engine import VllmEngine

            return VllmEngine.from_config(
                self.config.agentlightning.vllm, self.config.actor_rollout_ref.model.path, name
            )
        from agl_core.serving.policy_server import PolicyServer

        return PolicyServer(self.model, self.tokenizer, name, seed=int(self.config.trainer.seed))

    # -- the step loop's interface --------------------------------------------------------------

    def update(self, prepared: PreparedBatch) -> dict[str, float]:
        """The actor update (:class:`ActorUpdate`, which steps the lr schedule)."""
        return self.actor_update(prepared)

    def serve(self, version: int) -> Served:
        """Push the weights to the engine (made and started by the first call; its sampler state
        restored on a resumed run). A vLLM server that died (its rollouts this step failed and were
        counted) is started again (an attached one: waited for, up to
        ``agentlightning.vllm.startup_timeout_seconds``) and pushed to once more; a second failure ends
        training."""
        if self.engine is None:
            self.engine = self.make_engine()
            self.engine.start()
            self.engine.push_weights(self.model, version)
            if self._sampler_state is not None:
                self.engine.restore_sampler_state(self._sampler_state)
            return Served([self.engine.base_url])
        restarts = 0
        try:
            self.engine.push_weights(self.model, version)
        except VllmEngineError as exc:
            logger.warning("weight push failed, restarting the vLLM engine: %s", exc)
            self.engine.start()
            self.engine.push_weights(self.model, version)
            restarts = 1
        return Served([self.engine.base_url], {"training/engine/n_restarts": float(restarts)})

    def save_checkpoint(self, folder: Path) -> dict[str, Any]:
        """The policy's files (:func:`~agl_core.backends.torch.checkpoint.save_weights`); the optimizer,
        lr schedule and the engine's sampler state as plain state."""
        save_weights(folder, self.model, self.tokenizer)
        self.copy_image_processor(Path(folder) / (ADAPTER_DIR if is_adapted(self.model) else MODEL_DIR))
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        sampler = self.engine.sampler_state() if self.engine is not None else None
        if sampler is not None:
            state["sampler_rng"] = sampler
        return state

    def load_checkpoint(self, folder: Path, state: Mapping[str, Any]) -> None:
        load_weights(folder, self.model)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._sampler_state = state.get("sampler_rng")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def fit(self, on_step: OnStep | None = None) -> None:
        """Train (the step loop), then export the merged policy when the config asks for it."""
        super().fit(on_step)
        self.export_merged()

    def export_merged(self) -> None:
        """Write the policy (a LoRA run's adapters merged in) to ``agentlightning.torch.merged_model_dir``, if set."""
        folder = self.config.agentlightning.torch.merged_model_dir
        if folder:
            save_served(self.model, folder)
            self.tokenizer.save_pretrained(folder)
            self.copy_image_processor(Path(folder))
            logger.info("wrote the merged policy to %s", folder)

    def copy_image_processor(self, folder: Path) -> None:
        """Give a saved vision-language policy its image processor, without which it loads as text only."""
        if self.vision is not None:
            shutil.copyfile(Path(self.model_folder) / IMAGE_PROCESSOR_FILE, folder / IMAGE_PROCESSOR_FILE)
