"""The ``trl`` backend: agl's step loop (:class:`agl_core.LoopBackend`) around TRL's GRPO trainer.

agl owns the loop because a step yields a variable number of rows per rollout (turn-level
aggregation, dropped rows), which ``GRPOTrainer.train`` cannot take (it cuts a fixed generation
batch into ``steps_per_generation`` equal parts); agl's loop already gives every backend the same
rollout source, hooks, metrics, validation and checkpoints of the data position, RNG states and
carried rollouts; and TRL's model lives in this process, so the loop can drive it.

Per step (:meth:`TrlBackend.update`): the rows padded, the old (and reference) log-probs, then
``actor.ppo_epochs`` passes over the mini-batches, one optimizer step each through
:meth:`~agl_backend_trl.trainer.AglGRPOTrainer.mini_batch_step`, then the lr schedule's step and the
callbacks' step events. The weights are served with agl's in-process :class:`agl_core.PolicyServer`,
its copy of the policy made before TRL patches the model's forward (``add_fused_lm_head``), so
that serving reads only the weights pushed to it. A checkpoint holds the model (a LoRA run: the
adapter) as transformers' ``Trainer.save_model`` writes it, and the optimizer, lr schedule and
sampler states in the loop's ``trainer_state.pt``; a resume loads the model with ``Trainer``'s own loader.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agl_backend_trl.config import callback_classes, check_trl_config, grpo_config
from agl_backend_trl.trainer import AglGRPOTrainer
from agl_core import ConfigError, LoopBackend, LossSettings, PolicyServer, Served, load_policy_model, tensorize
from agl_core.backends.ppo import frozen_log_probs, mean_over_steps, mini_batches

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_core import PluginManager, PreparedBatch

__all__ = ["ADAPTER_DIR", "MODEL_DIR", "TrlBackend", "lora_config"]

logger = logging.getLogger(__name__)

MODEL_DIR = "model"
ADAPTER_DIR = "adapter"  # a LoRA run's checkpoint: the adapter only, as in the torch backend's checkpoints
RESPONSE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def lora_config(model_cfg: DictConfig) -> Any:
    """The PEFT ``LoraConfig`` handed to TRL as ``peft_config`` (``lora_rank`` > 0), from agl's keys in
    ``actor_rollout_ref.model`` as the torch backend reads them; ``None`` without LoRA."""
    if int(model_cfg.lora_rank) <= 0:
        return None
    from omegaconf import OmegaConf
    from peft import LoraConfig, TaskType

    def names(value: Any) -> Any:
        return OmegaConf.to_object(value) if OmegaConf.is_config(value) else value

    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=int(model_cfg.lora_rank),
        lora_alpha=int(model_cfg.lora_alpha),
        target_modules=names(model_cfg.target_modules),
        exclude_modules=names(model_cfg.exclude_modules),
        bias="none",
    )


class TrlBackend(LoopBackend):
    """The backend ``trl``: :class:`AglGRPOTrainer` trains in this process, a :class:`PolicyServer`
    serves; :meth:`~agl_core.LoopBackend.fit` trains."""

    def __init__(self, config: DictConfig, plugins: PluginManager):
        from datasets import Dataset
        from transformers import AutoTokenizer

        check_trl_config(config)
        folder = str(config.actor_rollout_ref.model.path)
        super().__init__(config, plugins, AutoTokenizer.from_pretrained(folder))
        actor = config.actor_rollout_ref.actor
        self.pad_token_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        torch.manual_seed(int(config.trainer.seed))
        model = load_policy_model(folder, dtype=torch.float32)
        # made before TRL patches the model's forward: the served copy must not call back into the policy
        self.server = PolicyServer(model, self.tokenizer, folder, seed=int(config.trainer.seed))
        self.trainer = AglGRPOTrainer(
            model,
            args=grpo_config(config, self.run_dir),
            train_dataset=Dataset.from_dict({"prompt": [""]}),  # agl's DataOrder feeds the steps
            processing_class=self.tokenizer,
            callbacks=[cls() for cls in callback_classes(config)],
            peft_config=lora_config(config.actor_rollout_ref.model),
            loss_fn=plugins.policy_losses.get(actor.policy_loss.loss_mode),
            loss_settings=LossSettings.from_actor_config(actor),
            entropy_coeff=float(actor.entropy_coeff),
            grad_clip=float(actor.grad_clip),
        )
        trainer = self.trainer
        if trainer.args.gradient_checkpointing:  # what Trainer.train does first
            trainer.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs or {"use_reentrant": False}
            )
        trainer.create_optimizer_and_scheduler(num_training_steps=self.total_steps)
        trainer.model_wrapped, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
        trainer.state.max_steps = self.total_steps
        self.device = trainer.accelerator.device
        self._began = False

    @property
    def model(self) -> torch.nn.Module:
        """The policy being trained (a LoRA run: the PEFT model), unwrapped."""
        return self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)

    # -- the step loop's interface --------------------------------------------------------------

    def update(self, prepared: PreparedBatch) -> dict[str, float]:
        """PPO epochs over the mini-batches on TRL's trainer, then the lr schedule's step."""
        assert prepared.shaped is not None
        trainer = self.trainer
        if not self._began:
            trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
            self._began = True
        trainer.state.global_step = self.step - 1
        trainer.callback_handler.on_step_begin(trainer.args, trainer.state, trainer.control)
        padded = tensorize(prepared.shaped.rows, pad_token_id=self.pad_token_id)
        rows = {name: padded.tensors[name].to(self.device) for name in RESPONSE_KEYS}
        old_log_prob = frozen_log_probs(trainer.model_wrapped, rows)
        with torch.no_grad():
            ref_log_prob = trainer.reference_log_probs(rows)
        advantages = prepared.advantages(rows["responses"].shape[1]).to(self.device)
        steps = [
            trainer.mini_batch_step(
                {
                    "rows": {name: value[part] for name, value in rows.items()},
                    "old_log_prob": old_log_prob[part],
                    "advantages": advantages[part],
                    "ref_log_prob": None if ref_log_prob is None else ref_log_prob[part],
                }
            )
            for _ in range(int(self.config.actor_rollout_ref.actor.ppo_epochs))
            for part in mini_batches(len(prepared.shaped.rows), prepared.shaped.n_mini_batches)
        ]
        metrics = {**mean_over_steps(steps), "actor/lr": float(trainer.lr_scheduler.get_last_lr()[0])}
        if metrics["actor/n_updates"] > metrics.get("actor/n_skipped_nonfinite_grad", 0.0):
            trainer.lr_scheduler.step()  # the schedule advances with the optimizer only
        trainer.state.global_step = self.step
        trainer.state.epoch = float(self.data.epoch)
        trainer.callback_handler.on_step_end(trainer.args, trainer.state, trainer.control)
        trainer.callback_handler.on_log(trainer.args, trainer.state, trainer.control, logs=metrics)
        return metrics

    def serve(self, version: int) -> Served:
        """Push the policy's weights to the in-process server (started by the first call; idempotent)."""
        self.server.start()
        self.server.push_weights(self.model, version)
        return Served([self.server.base_url])

    def save_checkpoint(self, folder: Path) -> dict[str, Any]:
        """The model (or adapter) as ``Trainer.save_model`` writes it; optimizer, schedule, sampler state."""
        self.trainer.save_model(str(Path(folder) / self.weights_dir()))
        return {
            "optimizer": self.trainer.optimizer.state_dict(),
            "scheduler": self.trainer.lr_scheduler.state_dict(),
            "sampler_rng": self.server.sampler_state(),
        }

    def load_checkpoint(self, folder: Path, state: Mapping[str, Any]) -> None:
        weights = Path(folder) / self.weights_dir()
        if not weights.is_dir():
            raise ConfigError(
                "actor_rollout_ref.model.lora_rank",
                f"checkpoint {folder} has no {self.weights_dir()}/ folder: it was written by a run "
                f"{'without' if self.weights_dir() == ADAPTER_DIR else 'with'} LoRA",
            )
        self.trainer._load_from_checkpoint(str(weights))
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.trainer.lr_scheduler.load_state_dict(state["scheduler"])
        self.server.restore_sampler_state(state["sampler_rng"])

    def weights_dir(self) -> str:
        return ADAPTER_DIR if self.config.actor_rollout_ref.model.lora_rank > 0 else MODEL_DIR

    def close(self) -> None:
        if self._began:
            trainer = self.trainer
            trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
        self.server.close()
