"""The verl trainer: verl's ``RayPPOTrainer`` (FSDP workers, vLLM replicas) with agl's training step.

One step (:meth:`AglRayPPOTrainer.train_step`) on the samples the step loop hands it (async: they
top the rollout source's in-flight groups up), in order: replicas resumed → rollouts through the
rollout source → (async: the gateway paused and drained; sync: leftover replica requests aborted) →
:meth:`learn`: the configured aggregator → advantages on every collected row
(:mod:`agl_backend_verl.advantages`) → batch shaping (whole rollouts dropped, marked ones first) →
replicas slept → tensorise → ``DataProto`` with the advantages (scaled per rollout under
``per_rollout_mean``) and the unscaled ``returns``, both one value per rollout → rows put in the
order that makes verl's dispatch train the torch backend's mini-batches
(:mod:`agl_backend_verl.dispatch`) → old log-probs / reference / values through verl's workers →
(``gae``: advantages and returns from the values, as verl's trainer orders it) → critic / actor
update → weights pushed
→ the replicas' addresses registered with the gateway with ``version`` = step (stale ones deleted
first; async: the gateway resumed). The loop around the step (validation over all validation
batches, reporting, checkpoints) is the one every backend runs, :func:`agl_core.backends.loop.run_steps`.

Only the calls of :class:`~agl_backend_verl.worker_calls.WorkerCalls` need GPUs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.utils.data import Dataset
from verl import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils.metric import reduce_metrics

from agl_backend_verl.advantages import advantages_from_values, compute_advantages, needs_values
from agl_backend_verl.config import validate_verl
from agl_backend_verl.dataproto import to_dataproto
from agl_backend_verl.dispatch import dispatch_order
from agl_backend_verl.verl_plugins import ensure_registered
from agl_backend_verl.worker_calls import VerlWorkerCalls, WorkerCalls
from agl_core import (
    CompletedRollout,
    LoopSettings,
    OnStep,
    PluginManager,
    RolloutSource,
    Step,
    StepPipeline,
    StepSamples,
    run_steps,
    tensorize,
    validation_metrics,
)

logger = logging.getLogger(__name__)

SOURCE_STATE = "agl_rollout_source.pt"
"""The rollout source's state (async: groups in flight, waiting samples) in verl's step folder."""

StepReport = tuple[int, int, dict[str, float], StepSamples]
"""``(step, total_steps, metrics, samples)``: what the trainer yields, and its Ray actor streams."""


class SampleDataset(Dataset):
    """In-memory dataset rows (JSON-like dicts); each becomes one rollout group's ``input``."""

    def __init__(self, samples: Sequence[Mapping[str, Any]], name: str):
        if isinstance(samples, (str, bytes, Mapping)) or not isinstance(samples, Sequence) or not samples:
            raise ValueError(f"{name} must be a non-empty list of dicts, got {type(samples).__name__}")
        for i, sample in enumerate(samples):
            if not isinstance(sample, Mapping) or not all(isinstance(k, str) for k in sample):
                raise ValueError(f"{name}[{i}] must be a dict with string keys, got {sample!r:.80}")
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        return self.samples[index]


def collate_samples(samples: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """A batch is the list of its samples: rollouts need the rows as they are, not as tensors."""
    return list(samples)


class AglRayPPOTrainer(RayPPOTrainer):
    """``RayPPOTrainer`` whose rollouts come from agl's rollout source and whose step is agl's.

    ``rollout_source`` is built by the caller (the gateway source); ``worker_calls`` defaults to
    verl's workers once :meth:`init_workers` has run.
    """

    def __init__(
        self,
        *args: Any,
        plugins: PluginManager,
        rollout_source: RolloutSource,
        worker_calls: WorkerCalls | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        validate_verl(self.config)
        self.plugins = plugins
        self.source = rollout_source
        self.calls = worker_calls
        ensure_registered(str(self.config.actor_rollout_ref.actor.policy_loss.loss_mode))
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.pipeline = StepPipeline(
            self.config,
            plugins,
            self.tokenizer,
            estimate=lambda rows: compute_advantages(rows, self.config, plugins, self.pad_token_id),
        )
        self.is_async = bool(self.config.agentlightning.async_rollout.enabled)
        self.global_steps = 0
        self._batches: Iterator[list[Mapping[str, Any]]] | None = None
        self.epoch = 0

    def init_workers(self) -> None:
        super().init_workers()
        self.calls = VerlWorkerCalls(self)

    @property
    def step(self) -> int:
        """Training steps done (verl's ``global_steps``; a resumed run starts at its checkpoint's)."""
        return self.global_steps

    def next_batch(self) -> list[Mapping[str, Any]]:
        """The data loader's next batch; past its end, the first of the next epoch."""
        while True:
            if self._batches is None:
                self._batches = iter(self.train_dataloader)
            batch = next(self._batches, None)
            if batch is not None:
                return batch
            self._batches = None
            self.epoch += 1

    # -- the loop -------------------------------------------------------------------------------

    def _register_replicas(self, version: int) -> None:
        self.source.after_weight_update(self.calls.rollout_endpoints(), version)

    def fit(self, on_step: OnStep | None = None) -> None:  # type: ignore[override]
        """Train until ``total_training_steps``; ``on_step(step, total, metrics, samples)`` sees every
        step (and a validation before the first step, as step 0)."""
        for step, total, metrics, samples in self.steps():
            if on_step is not None:
                on_step(step, total, metrics, samples)

    def steps(self) -> Iterator[StepReport]:
        """Train (:func:`~agl_core.backends.loop.run_steps`), yielding each step's report after it
        (step 0: the validation before training)."""
        self.global_steps = 0
        self.source.on_rollout_done = self.pipeline.prepare_rollout
        self.calls.load_checkpoint()
        self.calls.push_weights(self.global_steps)
        self._register_replicas(self.global_steps)
        settings = LoopSettings.from_config(
            self.config, self.total_training_steps, val_only=bool(self.config.trainer.val_only)
        )
        carried = self._restore_source()
        settings = attrs.evolve(settings, fill=max(0, settings.fill - carried))  # the fill counts what is carried
        for step in run_steps(self, settings):
            yield self._report(step)

    def _report(self, step: Step) -> StepReport:
        """A step with its sample tables, for the driver: ``agl train``'s metric sinks (``trainer.logger``)
        log both there, as for every backend."""
        return (*step, self.pipeline.take_samples())

    def _source_state_path(self) -> Path:
        """Where the checkpoint of step ``global_steps`` keeps the rollout source's state, in verl's folder."""
        return Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}" / SOURCE_STATE

    def save(self) -> None:
        """verl's checkpoint of the step, plus the rollouts the source carries into the next step (async)."""
        self.calls.save_checkpoint()
        in_flight = self.source.state()
        if in_flight is not None:
            torch.save(in_flight, self._source_state_path())

    def _restore_source(self) -> int:
        """After verl resumed at a checkpoint: give the source what it carried then; the samples it carries."""
        path = self._source_state_path()
        if self.global_steps == 0 or not path.is_file():
            return 0
        return self.source.restore(torch.load(path, weights_only=False))

    def train_step(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Train step ``global_steps + 1`` and advance ``global_steps``: rollouts for ``samples``,
        then :meth:`learn`, then the new weights served and registered."""
        self.global_steps += 1
        step = self.global_steps
        started = time.perf_counter()
        self.calls.resume_replicas()
        collected = self.source.collect(samples, step=step, is_train=True)
        metrics: dict[str, float] = dict(collected.metrics)
        if self.is_async:
            metrics.update(self.source.before_weight_update())  # pause and drain the gateway
        else:
            self.calls.abort_replicas()
        metrics["timing/gen_s"] = time.perf_counter() - started
        metrics.update(self.learn(collected.rollouts))
        started = time.perf_counter()
        self.calls.push_weights(step)
        self._register_replicas(step)
        metrics["timing/update_weights_s"] = time.perf_counter() - started
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(self.epoch)
        return metrics

    def learn(self, rollouts: Sequence[CompletedRollout]) -> dict[str, float]:
        """Everything between the rollouts and the update, then the update itself."""
        prepared = self.pipeline.prepare(rollouts, self.global_steps)
        metrics = dict(prepared.metrics)
        shaped = prepared.shaped
        self.calls.sleep_replicas()
        if shaped is None:
            return metrics
        started = time.perf_counter()
        padded = tensorize(shaped.rows, pad_token_id=self.pad_token_id)
        batch = to_dataproto(padded, meta_info={"temperature": self.config.actor_rollout_ref.rollout.temperature})
        width = padded.tensors["responses"].shape[1]
        batch.batch["advantages"] = prepared.advantages(width)  # scaled per rollout for per-rollout losses
        batch.batch["returns"] = prepared.returns(width)  # per rollout, as Agent Lightning v1.0 puts them
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        order = self.order_for_workers(batch, shaped.n_mini_batches, metrics)
        scored = time.perf_counter()
        old, old_metrics = self.calls.old_log_probs(batch)
        batch = batch.union(old)
        metrics.update(old_metrics)
        if self.use_reference_policy:
            batch = batch.union(self.calls.ref_log_probs(batch))
        if self.use_critic:
            batch = batch.union(self.calls.values(batch))
        if needs_values(self.config):  # gae: advantages and returns from the critic's values, as verl orders it
            batch = advantages_from_values(batch, self.config)
            if prepared.row_scales is not None:
                scales = torch.as_tensor(prepared.row_scales, dtype=torch.float32)[order]
                batch.batch["advantages"] *= scales[:, None]
        updated = time.perf_counter()
        metrics["timing/log_prob_s"] = (
            updated - scored
        )  # old, reference and critic values, as the torch backend times them
        if self.use_critic:
            metrics.update(reduce_metrics(self.calls.update_critic(batch)))
        if self.config.trainer.critic_warmup <= self.global_steps:
            metrics.update(reduce_metrics(self.calls.update_actor(batch)))
        metrics["timing/actor_update_s"] = time.perf_counter() - updated
        metrics["timing/update_s"] = time.perf_counter() - started
        return metrics

    def order_for_workers(self, batch: DataProto, n_mini_batches: int, metrics: dict[str, float]) -> list[int]:
        """Put the batch's rows in :func:`~agl_backend_verl.dispatch.dispatch_order` (in place), so that
        verl's dispatch over the actor's data-parallel ranks trains the torch backend's mini-batches,
        balanced within each mini-batch under ``trainer.balance_batch``; the order applied."""
        seqlens = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
        balance = bool(self.config.trainer.balance_batch)
        order, balance_metrics = dispatch_order(seqlens, n_mini_batches, self.calls.actor_dp_size(), balance)
        batch.reorder(torch.as_tensor(order))
        batch.meta_info["global_token_num"] = [seqlens[i] for i in order]
        metrics.update(balance_metrics)
        return order

    def validate(self) -> dict[str, float]:
        """One validation pass over every validation batch; ``val/*`` metrics over all of them
        (:func:`~agl_core.stages.pipeline.validation_metrics`)."""
        rollouts: list[CompletedRollout] = []
        source_metrics: list[dict[str, float]] = []
        self.calls.resume_replicas()
        for samples in self.val_dataloader:
            batch = self.source.collect(samples, step=self.global_steps, is_train=False)
            rollouts.extend(batch.rollouts)
            source_metrics.append(batch.metrics)
        if not self.is_async:
            self.calls.abort_replicas()
        return validation_metrics(rollouts, source_metrics)
