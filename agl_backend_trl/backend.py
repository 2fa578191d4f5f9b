"""The ``trl`` backend: agl's step loop (:class:`agl_core.LoopBackend`) around TRL's GRPO trainer.

agl owns the loop because a step yields a variable number of rows per rollout (turn-level
aggregation, dropped rows), which ``GRPOTrainer.train`` cannot take (it cuts a fixed generation
batch into ``steps_per_generation`` equal parts); agl's loop already gives every backend the same
rollout source, hooks, metrics, validation and checkpoints of the data position, RNG states and
carried rollouts; and TRL's model lives in this process, so the loop can drive it.

Per step (:meth:`TrlBackend.update`): the rows padded, the old (and reference) log-probs, then
``actor.ppo_epochs`` passes over the mini-batches, one optimizer step each (the toolkit's
:func:`~agl_core.backends.ppo.train_batch`: TRL's model forward, agl's loss, the backward through
TRL's accelerator, the callbacks' optimizer events around the step), then the lr schedule's step and
the callbacks' step events. What the callbacks then ask in TRL's ``TrainerControl`` steers agl's loop
(:meth:`TrlBackend.control`): ``should_evaluate`` a validation (their ``on_evaluate`` gets its
``val/*`` metrics), ``should_save`` a checkpoint (then ``on_save``), ``should_training_stop`` the end of
the run after the step. The weights are served with agl's in-process :class:`agl_core.PolicyServer`,
its copy of the policy made before TRL patches the model's forward (``add_fused_lm_head``), so
that serving reads only the weights pushed to it. A checkpoint holds the model (a LoRA run: the
adapter) as transformers' ``Trainer.save_model`` writes it, and the optimizer, lr schedule and
sampler states in the loop's ``trainer_state.pt``, and the state of the callbacks that export it
(transformers' ``ExportableState``); a resume loads the model with ``Trainer``'s own loader.

Several processes (``torchrun --nproc-per-node N -m agl_core.cli train ...``, accelerate's
data-parallel process model over gloo, on CPU with ``trl.use_cpu``; on GPUs refused so far): process
0 runs the loop (rollouts, hooks, serving, metrics, checkpoints); the others wait in
:meth:`TrlBackend.follow` and do what it tells them (:meth:`~TrlBackend.train` each step's rows,
:meth:`~TrlBackend.load_checkpoint` on a resume) until it stops. Each trains its share of every
mini-batch, and the gradients are averaged over the processes before each optimizer step
(:func:`~agl_backend_trl.trainer.average_gradients`), so N processes make the one-process update.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import DistributedType, broadcast_object_list, gather_object
from omegaconf import OmegaConf
from transformers.trainer_callback import ExportableState, PrinterCallback

from agl_backend_trl.config import build_callbacks, check_trl_config, grpo_config
from agl_backend_trl.trainer import AglGRPOTrainer, average_gradients
from agl_core import (
    ConfigError,
    LoopBackend,
    LoopControl,
    LossSettings,
    PolicyServer,
    Served,
    UsageError,
    tensorize,
)
from agl_core.backends.dropout import load_update_model
from agl_core.backends.lora import load_adapter, lora_config, lora_enabled
from agl_core.backends.micro_batching import MiniBatch, UpdateBatch, batch_results, split, split_rows
from agl_core.backends.ppo import (
    ActorLoss,
    ActorStep,
    DataParallel,
    ResponseStats,
    check_splittable,
    frozen_log_probs,
    mini_batches,
    rank_rows,
    response_stats,
    take_rows,
    train_batch,
    trainable_parameters,
)

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_core import CompletedRollout, PluginManager, PreparedBatch

__all__ = ["ADAPTER_DIR", "MODEL_DIR", "TrlBackend"]

logger = logging.getLogger(__name__)

MODEL_DIR = "model"
ADAPTER_DIR = "adapter"  # a LoRA run's checkpoint: the adapter only, as in the torch backend's checkpoints
# Each pass's token-budget micro-batches, as verl's keys set them: (the switch, the budget).
UPDATE = ("actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
OLD_LOG_PROBS = (
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
)
REF_LOG_PROBS = (
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
)
DATA_PARALLEL = (DistributedType.NO, DistributedType.MULTI_CPU)
"""accelerate's process models this backend trains in: one process, or data-parallel CPU
processes (several GPU processes over NCCL are not proven yet)."""


class TrlBackend(LoopBackend):
    """The backend ``trl``: :class:`AglGRPOTrainer` trains in this process, a :class:`PolicyServer`
    serves; :meth:`~agl_core.LoopBackend.fit` trains."""

    def __init__(self, config: DictConfig, plugins: PluginManager):
        from datasets import Dataset
        from transformers import AutoTokenizer

        check_trl_config(config)
        folder = str(config.actor_rollout_ref.model.path)
        super().__init__(config, plugins, AutoTokenizer.from_pretrained(folder))
        actor, model_cfg = config.actor_rollout_ref.actor, config.actor_rollout_ref.model
        args = grpo_config(config, self.run_dir)
        check_processes(args, int(actor.ppo_mini_batch_size) * int(config.actor_rollout_ref.rollout.n))
        self.rank, self.world = args.process_index, args.world_size
        self.micro_rows = actor.ppo_micro_batch_size_per_gpu
        loss_fn = plugins.policy_losses.get(actor.policy_loss.loss_mode)
        if actor.use_dynamic_bsz:
            check_splittable(loss_fn, UPDATE[0], "micro-batches")
        elif self.micro_rows is not None:
            check_splittable(loss_fn, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "micro-batches")
        if self.world > 1:
            check_splittable(
                loss_fn, "actor_rollout_ref.actor.policy_loss.loss_mode", f"{self.world} data-parallel processes"
            )
        self.pad_token_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        torch.manual_seed(int(config.trainer.seed))
        # on the device TRL trains on, so that the served copy generates there too
        model = load_update_model(
            folder, disable_dropout=bool(config.agentlightning.disable_dropout), device=args.device
        )
        # made before TRL patches the model's forward: the served copy must not call back into the policy
        seed = int(config.trainer.seed)
        self.server = PolicyServer(model, self.tokenizer, folder, seed=seed) if self.rank == 0 else None
        self.trainer = AglGRPOTrainer(
            model,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [""]}),  # agl's DataOrder feeds the steps
            processing_class=self.tokenizer,
            callbacks=build_callbacks(config),
            peft_config=lora_config(model_cfg) if lora_enabled(model_cfg) else None,
        )
        trainer = self.trainer
        trainer.remove_callback(PrinterCallback)  # it prints every step's logs; agl's metric sinks report them
        if lora_enabled(model_cfg):
            load_adapter(trainer.model, model_cfg)
        if trainer.args.gradient_checkpointing:  # what Trainer.train does first
            trainer.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs or {"use_reentrant": False}
            )
        trainer.create_optimizer_and_scheduler(num_training_steps=self.total_steps)
        # Not wrapped in DDP (``evaluation_mode``): the step averages the gradients itself. DDP
        # keeps the process group alive until the interpreter exits, and a gloo worker thread that
        # releases a finished collective then aborts the exit ("terminate called without an active
        # exception"); without it, :meth:`fit` ends the group and joins those threads.
        trainer.model_wrapped = trainer.accelerator.prepare_model(trainer.model, evaluation_mode=True)
        trainer.optimizer = trainer.accelerator.prepare_optimizer(trainer.optimizer)
        trainer.state.max_steps = self.total_steps
        self.device = trainer.accelerator.device
        parameters = trainable_parameters(self.model)
        average = functools.partial(average_gradients, parameters)
        self.actor_step = ActorStep(
            forward=self._stats,
            loss=ActorLoss(loss_fn, LossSettings.from_actor_config(actor), float(actor.entropy_coeff), trainer.beta),
            optimizer=trainer.optimizer,
            parameters=parameters,
            grad_clip=float(actor.grad_clip),
            data_parallel=None
            if self.world == 1
            else DataParallel(self.world, gather_object, reduce_gradients=average),
            backward=trainer.accelerator.backward,
            optimizer_events=self._optimizer_events,
        )
        self._began = False

    @property
    def model(self) -> torch.nn.Module:
        """The policy being trained (a LoRA run: the PEFT model), unwrapped."""
        return self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped)

    # -- the step loop's interface --------------------------------------------------------------

    def update(self, prepared: PreparedBatch) -> dict[str, float]:
        """:meth:`train` on the prepared rows, in every process."""
        assert prepared.shaped is not None
        padded = tensorize(prepared.shaped.rows, pad_token_id=self.pad_token_id)
        rows = take_rows(padded.tensors, slice(None))
        advantages = prepared.advantages(rows["responses"].shape[1])
        batch = (rows, advantages, prepared.shaped.n_mini_batches, self.step, float(self.data.epoch))
        self.tell("train", *batch)
        return self.train(*batch)

    def train(
        self, rows: dict[str, torch.Tensor], advantages: torch.Tensor, n_mini_batches: int, step: int, epoch: float
    ) -> dict[str, float]:
        """Step ``step``'s actor update on TRL's trainer: the toolkit's
        :func:`~agl_core.backends.ppo.train_batch` (PPO epochs over the mini-batches, this process
        training its rows of each, then the lr schedule's step); the update's metrics, with
        ``actor/n_processes`` (the data-parallel processes that trained it) and ``timing/log_prob_s``
        (the old and reference log-probs), as the torch backend reports them."""
        trainer = self.trainer
        trainer.state.global_step = step - 1
        self.event("on_step_begin")
        started = time.perf_counter()
        rows = {name: value.to(self.device) for name, value in rows.items()}
        advantages = advantages.to(self.device)
        minis = [
            MiniBatch(
                self._micro_batches(rows, advantages, rank_rows(part, self.rank, self.world)),
                int(rows["response_mask"][part].sum()),
            )
            for part in mini_batches(len(advantages), n_mini_batches)
        ]
        log_probs_done = time.perf_counter()
        trainer.model_wrapped.train()
        epochs = int(self.config.actor_rollout_ref.actor.ppo_epochs)
        metrics = {
            **train_batch(self.actor_step, minis, epochs=epochs, scheduler=trainer.lr_scheduler),
            "actor/n_processes": float(self.world),
            "timing/log_prob_s": log_probs_done - started,
            "timing/actor_update_s": time.perf_counter() - log_probs_done,
        }
        trainer.state.global_step = step
        trainer.state.epoch = epoch
        self.event("on_step_end")
        return metrics

    def _micro_batches(
        self, rows: dict[str, torch.Tensor], advantages: torch.Tensor, share: list[int]
    ) -> list[UpdateBatch]:
        """This process's ``share`` of a mini-batch in micro-batches (of rows, or of a token budget:
        :meth:`_split`) with their advantages and old and reference log-probs, each log-prob pass in
        its own micro-batches (computed here, once for every PPO epoch)."""
        mine = take_rows(rows, share)
        old = self._pass(functools.partial(frozen_log_probs, self.model), mine, OLD_LOG_PROBS)
        ref = self._pass(self.trainer.reference_log_probs, mine, REF_LOG_PROBS) if self.trainer.beta else None
        rows_of_share = UpdateBatch(mine, advantages[share], old, ref)
        return [rows_of_share.cut(micro) for micro in self._split(mine, UPDATE)]

    def _stats(self, rows: UpdateBatch) -> ResponseStats:
        """The policy's response stats of ``rows``, through the model TRL wraps, in TRL's loss context
        (its autocast)."""
        with self.trainer.compute_loss_context_manager():
            return response_stats(self.trainer.model_wrapped, rows.tensors)

    @contextlib.contextmanager
    def _optimizer_events(self) -> Iterator[None]:
        """The callbacks' ``on_pre_optimizer_step`` and ``on_optimizer_step`` around the optimizer's step."""
        trainer = self.trainer
        trainer.callback_handler.on_pre_optimizer_step(trainer.args, trainer.state, trainer.control)
        yield
        trainer.callback_handler.on_optimizer_step(trainer.args, trainer.state, trainer.control)

    def _pass(self, log_probs: Any, tensors: dict[str, torch.Tensor], budget: tuple[str, str]) -> torch.Tensor:
        """``log_probs`` of every row of ``tensors``, ``[rows, response width]``, computed in the
        micro-batches of ``budget`` (no gradient)."""
        with torch.no_grad():
            return batch_results(tensors, self._split(tensors, budget), lambda micro: log_probs(micro.cut(tensors)))

    def _split(self, tensors: dict[str, torch.Tensor], budget: tuple[str, str]) -> list[Any]:
        """``tensors``' rows in micro-batches of the token budget ``budget`` names (with its switch
        on), else of ``actor.ppo_micro_batch_size_per_gpu`` rows."""
        switch, key = budget
        if OmegaConf.select(self.config, switch):
            return split(tensors, int(OmegaConf.select(self.config, key)), key)
        return split_rows(tensors, self.micro_rows)

    def control(self) -> LoopControl:
        """What the callbacks asked of the loop in ``TrainerControl`` (process 0's)."""
        control = self.trainer.control
        return LoopControl(
            validate=control.should_evaluate, save=control.should_save, stop=control.should_training_stop
        )

    def on_report(self, metrics: Mapping[str, float]) -> None:
        """The callbacks' ``on_log`` in every process, with every metric of the step (what
        ``metrics.jsonl`` gets), before the loop reads what they asked."""
        self.event_everywhere("on_log", dict(metrics))

    def validate(self) -> dict[str, float]:
        """agl's validation, then the callbacks' ``on_evaluate`` with its metrics in every process."""
        metrics = super().validate()
        self.event_everywhere("on_evaluate", metrics)
        return metrics

    def save(self) -> None:
        """agl's checkpoint, then the callbacks' ``on_save`` in every process."""
        super().save()
        self.event_everywhere("on_save")

    def event_everywhere(self, name: str, *payload: Any) -> None:
        """Process 0: :meth:`event` in every process."""
        self.tell("event", name, *payload)
        self.event(name, *payload)

    def event(self, name: str, *payload: Any) -> None:
        """The callbacks' event ``name`` (``on_log``'s logs, ``on_evaluate``'s metrics as ``payload``),
        ``on_train_begin`` first."""
        trainer = self.trainer
        if not self._began:
            self._began = True
            self.event("on_train_begin")
        try:
            getattr(trainer.callback_handler, name)(trainer.args, trainer.state, trainer.control, *payload)
        except Exception as exc:
            raise callback_failure(exc, name, trainer.callback_handler.callbacks) from exc

    def serve(self, version: int) -> Served:
        """Push the policy's weights to the in-process server (started by the first call; idempotent);
        the push's seconds are ``timing/update_weights_s``."""
        assert self.server is not None, "process 0 serves"
        started = time.perf_counter()
        self.server.start()
        self.server.push_weights(self.model, version)
        return Served([self.server.base_url], {"timing/update_weights_s": time.perf_counter() - started})

    def save_checkpoint(self, folder: Path) -> dict[str, Any]:
        """The model (or adapter) as ``Trainer.save_model`` writes it; optimizer, schedule, sampler state
        (process 0's: every process makes the same optimizer steps)."""
        assert self.server is not None, "process 0 checkpoints"
        self.trainer.save_model(str(Path(folder) / self.weights_dir()))
        return {
            "optimizer": self.trainer.optimizer.state_dict(),
            "scheduler": self.trainer.lr_scheduler.state_dict(),
            "sampler_rng": self.server.sampler_state(),
            "callbacks": {type(callback).__name__: callback.state() for callback in self._stateful_callbacks()},
        }

    def load_checkpoint(self, folder: Path, state: Mapping[str, Any]) -> None:
        weights = Path(folder) / self.weights_dir()
        if not weights.is_dir():
            raise ConfigError(
                "actor_rollout_ref.model.lora_rank",
                f"checkpoint {folder} has no {self.weights_dir()}/ folder: it was written by a run "
                f"{'without' if self.weights_dir() == ADAPTER_DIR else 'with'} LoRA",
            )
        self.tell("load_checkpoint", folder, state)
        self.trainer._load_from_checkpoint(str(weights))
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.trainer.lr_scheduler.load_state_dict(state["scheduler"])
        if self.server is not None:
            self.server.restore_sampler_state(state["sampler_rng"])
        saved = state.get("callbacks", {})
        for callback in self._stateful_callbacks():
            name = type(callback).__name__
            if name not in saved:
                logger.warning("checkpoint %s holds no state of callback %s: it starts afresh", folder, name)
                continue
            for attribute, value in saved[name]["attributes"].items():
                setattr(callback, attribute, value)

    def _stateful_callbacks(self) -> list[Any]:
        return [cb for cb in self.trainer.callback_handler.callbacks if isinstance(cb, ExportableState)]

    def weights_dir(self) -> str:
        return ADAPTER_DIR if self.config.actor_rollout_ref.model.lora_rank > 0 else MODEL_DIR

    def close(self) -> None:
        self.tell("stop")
        if self._began:
            self.event("on_train_end")
        if self.server is not None:
            self.server.close()

    # -- several processes -----------------------------------------------------------------------

    def fit(self, on_step: Any = None) -> None:
        """Process 0 runs agl's loop; the others follow it. A run that ends cleanly ends the process
        group in every process, so that its worker threads are joined before the interpreter exits
        (after a failure a process may still wait in a collective: the launcher stops it)."""
        if self.rank == 0:
            super().fit(on_step)
        else:
            try:
                self.follow()
            finally:
                self.close()
        if self.world > 1:
            self.trainer.accelerator.end_training()

    def tell(self, command: str, *args: Any) -> None:
        """Process 0: have every other process call ``command(*args)`` too (``stop``: end :meth:`follow`)."""
        if self.rank == 0 and self.world > 1:
            broadcast_object_list([(command, args)], from_process=0)

    def follow(self) -> None:
        """A process other than 0: call what process 0 tells (:meth:`tell`) until it says ``stop``."""
        while True:
            message: list[Any] = [None]
            broadcast_object_list(message, from_process=0)
            command, args = message[0]
            if command == "stop":
                return
            getattr(self, command)(*args)

    def replay_step(self, rollouts: Sequence[CompletedRollout], step: int) -> dict[str, float]:
        if self.world > 1:
            raise ConfigError("agentlightning.backend", "backend 'trl' replays a step in one process only")
        return super().replay_step(rollouts, step)


def callback_failure(exc: Exception, event: str, callbacks: Sequence[Any]) -> UsageError:
    """The error of a callback that raised in ``event``, naming it (found in the traceback) and
    ``trl.callbacks``: a callback's failure is the user's to fix, not agl's internal error."""
    raised = [frame.f_locals.get("self") for frame, _ in traceback.walk_tb(exc.__traceback__)]
    culprit = next((cb for cb in reversed(raised) if any(cb is c for c in callbacks)), None)
    who = "a callback" if culprit is None else f"{type(culprit).__module__}:{type(culprit).__qualname__}"
    return UsageError(f"{who} (trl.callbacks) failed in {event}: {type(exc).__name__}: {exc}")


def check_processes(args: Any, mini_batch_rows: int) -> None:
    """Refuse a process model this backend does not train in, by what set it: accelerate's DeepSpeed
    or FSDP (its launch config) or several GPU processes, a launcher's processes accelerate does not
    join (CPU without ``trl.use_cpu``), more processes than a mini-batch has rows."""
    state = args.distributed_state
    if state.distributed_type not in DATA_PARALLEL:
        raise ConfigError(
            "agentlightning.backend",
            f"backend 'trl' trains in one process or data-parallel CPU processes, not accelerate's "
            f"{state.distributed_type.value} (set by the launcher and its config): it is not proven yet",
        )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != args.world_size:
        raise ConfigError(
            "trl.use_cpu",
            f"the launcher started {launched} processes (WORLD_SIZE) but accelerate joins {args.world_size}: "
            "on a machine without GPUs set trl.use_cpu=true, so that accelerate trains them over gloo",
        )
    if args.world_size > mini_batch_rows:
        raise ConfigError(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"a mini-batch has {mini_batch_rows} rows (ppo_mini_batch_size × rollout.n), fewer than the "
            f"{args.world_size} processes that each train a share of it",
        )
