"""verl's V1 trainer with agl's rollouts, credit assignment and losses.

verl 0.9.1's trainer (``verl.trainer.ppo.v1``) owns the loop in every ``trainer.v1.trainer_mode``
(``sync``, ``colocate_async``, ``separate_async``): validation before training, per step
``prepare_step`` (new prompts handed to the agent-loop manager) → ``_step_once`` → checkpoint →
``on_step_end`` (weights pushed to the replicas) → validation at ``trainer.test_freq`` → metrics
logged. :func:`trainer_class` puts :class:`AglTrainer` in front of the class verl registered for
the mode (``get_trainer_cls``), which changes what the loop does at a few points only:

- ``_step_once``: verl's replay buffer samples finished groups (its staleness bound and carry-over
  apply), then agl's step (:meth:`AglTrainer.learn`): the rollouts read back from TransferQueue →
  the step pipeline (aggregation, advantages on every collected row, shaping, per-rollout scaling) →
  the kept rows written to TransferQueue in the dispatch order → verl's own ``_compute_old_log_prob``,
  ``_compute_ref_log_prob``, ``_compute_values``, (``gae``: ``_compute_advantage``), ``_update_critic``,
  ``_update_actor``.
- ``on_sample_end``: the gateway paused and drained (async modes) before verl aborts and sleeps the
  replicas; in ``separate_async``, whose rollout pool keeps generating while the trainer trains, at
  ``on_step_end`` right before verl pushes the weights to that pool (the drain's metrics go with
  verl's weight-sync metrics); ``on_init_end`` / ``on_step_end``: after verl pushed the weights, the
  replicas registered with the gateway under the step's version (and the gateway resumed).
- ``_validate``: one rollout per validation row through the same agent-loop manager, agl's ``val/*`` metrics.
- ``_compute_metrics`` and ``logger``: the step's metrics are agl's (the torch backend's names), and
  what verl's loop logs goes to the step reports ``agl train`` receives (:class:`StepReports`).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from omegaconf import DictConfig
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1 import get_trainer_cls
from verl.utils.debug import marked_timer

from agl_backend_verl.advantages import compute_advantages, needs_values
from agl_backend_verl.agent_loop import RolloutLoopManager
from agl_backend_verl.config import validate_verl
from agl_backend_verl.dataset import INPUT_KEY
from agl_backend_verl.dispatch import dispatch_order
from agl_backend_verl.transfer import clear, partition, put_rows, read_rollouts, training_rows
from agl_core import (
    CompletedRollout,
    PluginManager,
    PreparedBatch,
    StepPipeline,
    StepSamples,
    VisionSpec,
    rollout_timing_metrics,
    tensorize,
    validation_metrics,
)

__all__ = ["AglTrainer", "StepReport", "StepReports", "trainer_class"]

logger = logging.getLogger(__name__)

StepReport = tuple[int, int, dict[str, float], StepSamples]
"""``(step, total_steps, metrics, samples)``: what the trainer reports after each step (step 0: the
validation before training), and what its Ray actor streams to ``agl train``."""


class StepReports:
    """Stands in for verl's ``Tracking`` (agl's metric sinks run in the ``agl train`` process): each
    ``log(data, step)`` of verl's loop becomes a :data:`StepReport`, with the step's sample tables,
    on ``trainer.reports``, the queue the task runner streams from."""

    def __init__(self, trainer: AglTrainer):
        self.trainer = trainer

    def log(self, data: Mapping[str, Any], step: int) -> None:
        metrics = {k: float(v) for k, v in data.items() if _is_number(v)}
        trainer = self.trainer
        trainer.reports.put((int(step), int(trainer.total_training_steps), metrics, trainer.pipeline.take_samples()))

    def finish(self, exit_code: int = 0) -> None:
        pass


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class AglTrainer:
    """The agl side of the trainer class :func:`trainer_class` builds (see the module docstring).

    ``plugins`` is the run's plugin manager; the agent-loop manager (a :class:`RolloutLoopManager`)
    is handed over by ``fit`` as verl's task runner does."""

    agent_loop_manager: RolloutLoopManager
    config: DictConfig

    def __init__(self, config: DictConfig, *, plugins: PluginManager):
        validate_verl(config)  # also a config that did not come through load_verl_config
        super().__init__(config)  # type: ignore[call-arg]
        self.plugins = plugins
        self.reports: queue.Queue[StepReport | None] = queue.Queue()
        self.step_metrics: dict[str, float] = {}
        self.resume_metrics: dict[str, float] = {}
        self.carried_over = 0.0  # rollouts the last step left running
        self.iterations: list[dict[str, float]] = []  # agl's metrics of each mini-batch of the step

    # -- set-up --------------------------------------------------------------------------------

    def _init_tokenizer(self) -> None:
        super()._init_tokenizer()  # type: ignore[misc]
        tokenizer = self.tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.vision = vision_spec(self.config.actor_rollout_ref.model.path)
        self.pipeline = StepPipeline(
            self.config,
            self.plugins,
            tokenizer,
            estimate=lambda rows: compute_advantages(rows, self.config, self.plugins, self.pad_token_id),
        )

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()  # type: ignore[misc]
        from agl_backend_verl.cpu import is_cpu

        if is_cpu(self.config):
            from agl_backend_verl.cpu.resources import CpuResourcePoolManager

            self.resource_pool_manager = CpuResourcePoolManager.like(self.resource_pool_manager)

    def _build_replay_buffer(self) -> Any:
        """verl's replay buffer, whose wait between polls for finished groups first raises what ended
        agl's rollout loop: ``sample`` otherwise polls forever for groups a failed loop never stores
        (a TransferQueue storage unit lost with its node, a gateway that stopped answering)."""
        buffer = super()._build_replay_buffer()  # type: ignore[misc]
        wait = buffer._wait_for_next_poll

        def wait_unless_failed(partition_id: str, last_debug_time: float) -> float:
            loop = getattr(self, "agent_loop_manager", None)
            if loop is not None:
                loop.raise_failure()
            return wait(partition_id, last_debug_time)

        buffer._wait_for_next_poll = wait_unless_failed
        return buffer

    # -- reporting -----------------------------------------------------------------------------

    @property
    def logger(self) -> StepReports:
        """Where verl's loop logs: the step reports."""
        return StepReports(self)

    @logger.setter
    def logger(self, tracking: Any) -> None:
        """verl's loop sets its ``Tracking`` at the start of ``fit``; it is not used (see :class:`StepReports`)."""

    def _compute_metrics(self, batch: KVBatchMeta, metrics: dict, timing_raw: dict, global_steps: int, epoch: int):
        """The step's metrics under the torch backend's names (verl's own data metrics are not computed:
        agl's pipeline reports the batch)."""
        metrics.update(combine_iterations(self.iterations))
        self.iterations = []
        metrics.update(self.agent_loop_manager.pop_counts())
        metrics.update(self.plugins.pop_metrics())
        metrics.update(self.resume_metrics)
        self.resume_metrics = {}
        metrics["training/global_step"] = float(global_steps)
        metrics["training/epoch"] = float(epoch)
        for name, key in (
            ("gen", "timing/gen_s"),
            ("step", "timing/step_s"),
            ("update_weights", "timing/update_weights_s"),
        ):
            if name in timing_raw:
                metrics[key] = float(timing_raw[name])
        if "testing" in timing_raw:
            metrics["timing/val_s"] = float(timing_raw["testing"])

    # -- the replicas and the gateway ----------------------------------------------------------

    def serving_endpoints(self) -> list[str]:
        """The OpenAI base URLs of the replicas that serve agents (registered with the gateway)."""
        managers = [self.llm_server_manager]
        standalone = getattr(self, "standalone_server_manager", None)
        if standalone is not None:
            managers = [standalone]
        return [_endpoint(address) for manager in managers for address in manager.server_addresses]

    def register_replicas(self) -> None:
        """Register the serving replicas with the rollout source (the gateway) under the current
        weights' version, then tell the plugins (``agl_on_weights_served``)."""
        endpoints = self.serving_endpoints()
        self.agent_loop_manager.after_weight_update(endpoints, self.global_steps)
        self.plugins.on_weights_served(endpoints, self.global_steps)

    def on_sample_end(self) -> None:
        if self.trainer_mode != "separate_async":  # type: ignore[attr-defined]
            self.step_metrics = self.agent_loop_manager.before_weight_update()  # async gateway: pause and drain
        super().on_sample_end()  # type: ignore[misc]

    def on_step_end(self) -> None:
        drained = {}
        if self.trainer_mode == "separate_async":  # type: ignore[attr-defined]
            drained = self.agent_loop_manager.before_weight_update()  # the rollout pool generates until the push
        super().on_step_end()  # type: ignore[misc]
        if drained:  # logged with verl's weight-sync metrics of the step
            self._pending_sync_metrics = {**(getattr(self, "_pending_sync_metrics", None) or {}), **drained}
        self.register_replicas()

    def _reissue_inflight_prompts(self, partition_id: str = "train") -> int:
        """verl restores the groups TransferQueue held at the checkpoint (async modes): finished ones are
        trained as they are, pending or running ones are started again. Counted in the first step:
        ``training/async/n_resumed_groups`` (all restored) and ``n_recreated_groups`` (started again)."""
        recreated = super()._reissue_inflight_prompts(partition_id)  # type: ignore[misc]
        restored = int(getattr(self, "_restored_tq_prompt_count", 0))
        if restored:
            self.resume_metrics = {
                "training/async/n_resumed_groups": float(restored),
                "training/async/n_recreated_groups": float(recreated),
            }
        return recreated

    def fit(self, agent_loop_manager: RolloutLoopManager) -> None:
        self.agent_loop_manager = agent_loop_manager
        self.register_replicas()  # the weights verl pushed at the end of init
        super().fit(agent_loop_manager)  # type: ignore[misc]

    # -- the training step ---------------------------------------------------------------------

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> KVBatchMeta:
        """Sample finished groups from verl's replay buffer and train on them with agl's step."""
        with marked_timer("gen", timing_raw, color="red"):
            self.on_sample_begin()  # type: ignore[attr-defined]
            sampled, off_policy = self.replay_buffer.sample(  # type: ignore[attr-defined]
                global_steps=self.global_steps, partition_id="train", batch_size=sample_batch_size
            )
            metrics.update(off_policy)  # verl's, which verl's loop combines over the step's mini-batches
            self.on_sample_end()
        self.agent_loop_manager.raise_failure()
        rollouts, keys = read_rollouts(sampled)
        iteration = {**self.step_metrics, **rollout_timing_metrics(rollouts)}
        self.step_metrics = {}
        if self.trainer_mode != "sync":  # type: ignore[attr-defined]
            iteration.update(self.carry_over_metrics(sampled, len(rollouts)))
        learned, row_keys = self.learn(rollouts, keys)
        self.iterations.append({**iteration, **learned})
        return KVBatchMeta(
            keys=[*sampled.keys, *row_keys],
            tags=[*sampled.tags, *({} for _ in row_keys)],
            partition_id=sampled.partition_id,
        )

    def carry_over_metrics(self, sampled: KVBatchMeta, n_trained: int) -> dict[str, float]:
        """Agent Lightning's carry-over metrics of an async step, from verl's replay buffer: the rollouts
        this step trains, those still running in groups it carries into the next step (and how many
        steps old the oldest carried group is), and what the previous step carried; under verl's
        staleness bound with ``max_off_policy_strategy: wait``, the groups the step waited for
        (``training/off_policy/n_waited_groups``; what ``drop`` evicts verl counts itself, as
        ``training/off_policy/evicted_samples``)."""
        buffer = self.replay_buffer  # type: ignore[attr-defined]
        selected = {key.split("_")[0] for key in sampled.keys}
        carried = buffer.pending_keys["train"] | buffer.running_keys["train"] | buffer.finished_keys["train"]
        carried -= selected
        started = buffer.prompt_global_steps["train"]
        in_flight = float(self.agent_loop_manager.n_pending())
        age = max((self.global_steps - started.get(uid, self.global_steps) for uid in carried), default=0)
        metrics = {
            "training/async/n_prev_carry_over_rollouts": self.carried_over,
            "training/async/n_completed_rollouts": float(n_trained),
            "training/async/n_new_carry_over_rollouts": in_flight,
            "training/async/new_carry_over_age_max_steps": float(age),
        }
        self.carried_over = in_flight
        sampler = self.config.trainer.v1.sampler
        if sampler.max_off_policy_threshold is not None and sampler.max_off_policy_strategy == "wait":
            bound = int(sampler.max_off_policy_threshold)  # verl waits while an in-flight group's span reaches it
            spans = [self.global_steps - started.get(uid, self.global_steps) + 1 for uid in selected]
            metrics["training/off_policy/n_waited_groups"] = float(sum(span >= bound for span in spans))
        return metrics

    def learn(
        self, rollouts: Sequence[CompletedRollout], keys: Mapping[str, str]
    ) -> tuple[dict[str, float], list[str]]:
        """agl's pipeline on ``rollouts`` (stored under ``keys``), then verl's updates on the kept rows;
        the metrics and the keys the rows were stored under."""
        prepared = self.pipeline.prepare(rollouts, self.global_steps)
        metrics = dict(prepared.metrics)
        shaped = prepared.shaped
        if shaped is None:
            return metrics, []
        started = time.perf_counter()
        if self.vision is None:
            padded = tensorize(shaped.rows, pad_token_id=self.pad_token_id)
        else:  # mrope position ids and each row's image inputs, as verl's agent loop writes them
            padded = tensorize(shaped.rows, pad_token_id=self.pad_token_id, vision=self.vision)
        seqlens = padded.tensors["attention_mask"].sum(dim=-1).tolist()
        order, balance = dispatch_order(
            seqlens, shaped.n_mini_batches, self.actor_dp_size(), bool(self.config.trainer.balance_batch)
        )
        metrics.update(balance)
        width = padded.tensors["responses"].shape[1]
        rollout_ids = padded.non_tensors["rollout_ids"]
        row_keys = _row_keys([str(rollout_ids[i]) for i in order], keys)
        rows = training_rows(padded, order, prepared.advantages(width), prepared.returns(width))
        batch = put_rows(rows, row_keys)
        scored = time.perf_counter()
        batch = self._compute_old_log_prob(batch, metrics=metrics)  # type: ignore[attr-defined]
        if self.use_reference_policy:  # type: ignore[attr-defined]
            batch = self._compute_ref_log_prob(batch, metrics=metrics)  # type: ignore[attr-defined]
        if self.use_critic:  # type: ignore[attr-defined]
            batch = self._compute_values(batch, metrics=metrics)  # type: ignore[attr-defined]
        if needs_values(self.config):  # gae: verl's advantages from the critic's values, then agl's scaling
            batch = self._compute_advantage(batch, metrics=metrics)  # type: ignore[attr-defined]
            scale_advantages(batch, prepared, order)
        # verl's _compute_ref_log_prob and _compute_values hand back the meta they were given, whose
        # field list (what the workers fetch) predates what they wrote: the updates read every field
        batch.fields = None
        updated = time.perf_counter()
        metrics["timing/log_prob_s"] = updated - scored
        if self.use_critic:  # type: ignore[attr-defined]
            batch = self._update_critic(batch, metrics=metrics)  # type: ignore[attr-defined]
        if self.config.trainer.critic_warmup <= self.global_steps:
            batch = self._update_actor(batch, metrics=metrics)  # type: ignore[attr-defined]
        metrics["timing/actor_update_s"] = time.perf_counter() - updated
        metrics["timing/update_s"] = time.perf_counter() - started
        return metrics, row_keys

    def actor_dp_size(self) -> int:
        """The actor's data-parallel size (how many contiguous shares verl's dispatch cuts a batch into)."""
        group = self.actor_rollout_wg  # type: ignore[attr-defined]
        if "actor" not in group._dispatch_info:
            group._dispatch_info["actor"] = group._query_dispatch_info("actor")
        return max(group._dispatch_info["actor"]) + 1

    # -- validation ----------------------------------------------------------------------------

    def _validate(self) -> dict[str, float]:
        """One rollout per validation row with the current weights, every batch; ``val/*`` metrics over
        all of them (:func:`~agl_core.validation_metrics`)."""
        import transfer_queue as tq
        from verl.utils import tensordict_utils as tu

        rollouts: list[CompletedRollout] = []
        counts: list[dict[str, float]] = []  # the source's, per batch
        for batch_dict in self.val_dataloader:  # type: ignore[attr-defined]
            uids = [new_uid() for _ in batch_dict[INPUT_KEY]]
            batch = tu.get_tensordict({**batch_dict, "uid": _objects(uids)})
            tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)
            tu.assign_non_tensor_data(batch, "validate", True)
            where = partition(False)
            tags = [{"is_prompt": True, "status": "pending", "global_steps": self.global_steps} for _ in uids]
            tq.kv_batch_put(keys=uids, partition_id=where, tags=tags)
            self.agent_loop_manager.generate_sequences(batch)
            sampled, _ = self.replay_buffer.sample(  # type: ignore[attr-defined]
                global_steps=self.global_steps, partition_id=where, batch_size=len(uids)
            )
            found, _keys = read_rollouts(sampled)
            rollouts.extend(found)
            counts.append(self.agent_loop_manager.pop_counts())
            clear(where, sampled.keys)
        return validation_metrics(rollouts, counts)


def combine_iterations(iterations: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """agl's metrics of a step trained in several mini-batches (separate_async's
    ``parameter_sync_step``), each sampled and prepared on its own: counts (``n_*`` in the name) and phase
    times (``timing/*_s``) add up, ``max`` and ``min`` statistics take the extreme, and the rest
    (rewards, losses, means) are averaged weighted by each mini-batch's rollouts. One mini-batch's
    metrics are returned as they are."""
    if len(iterations) == 1:
        return dict(iterations[0])
    weights = [float(it.get("training/n_rollouts", 1.0)) or 1.0 for it in iterations]
    combined: dict[str, float] = {}
    for key in {key for it in iterations for key in it}:
        present = [(it[key], w) for it, w in zip(iterations, weights) if key in it]
        values = [v for v, _ in present]
        last = key.rsplit("/", 1)[-1]
        words = last.split("_")
        if any(part.startswith("n_") for part in key.split("/")) or (key.startswith("timing/") and key.endswith("_s")):
            combined[key] = float(sum(values))
        elif "max" in words:
            combined[key] = float(max(values))
        elif "min" in words:
            combined[key] = float(min(values))
        else:
            combined[key] = float(sum(v * w for v, w in present) / sum(w for _, w in present))
    return combined


def scale_advantages(batch: KVBatchMeta, prepared: PreparedBatch, order: Sequence[int]) -> None:
    """Scale the rows' advantages in TransferQueue per rollout (:meth:`~agl_core.PreparedBatch.scale`;
    ``gae``, whose advantages verl computes after the critic's values): row ``j`` of ``batch`` is
    kept row ``order[j]``. Nothing when the loss uses no scales."""
    if prepared.row_scales is None:
        return
    import transfer_queue as tq
    from tensordict import TensorDict

    nested = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["advantages"])
    advantages = nested["advantages"]
    scaled = prepared.scale(advantages.to_padded_tensor(0.0), rows=order)
    lengths = advantages.offsets().diff().tolist()
    rows = torch.nested.as_nested_tensor([scaled[j, :n] for j, n in enumerate(lengths)], layout=torch.jagged)
    tq.kv_batch_put(
        keys=batch.keys,
        partition_id=batch.partition_id,
        fields=TensorDict({"advantages": rows}, batch_size=len(lengths)),
    )


def vision_spec(model_path: str) -> Any:
    """The model's ``VisionSpec`` when its folder has an image processor (a vision-language policy),
    else ``None``: its rows then carry mrope positions and image inputs."""
    from pathlib import Path

    from verl.utils.fs import copy_to_local

    folder = Path(copy_to_local(str(model_path)))
    if not (folder / "preprocessor_config.json").is_file():
        return None
    return VisionSpec.from_pretrained(folder)


def _row_keys(rollout_ids: Sequence[str], record_keys: Mapping[str, str]) -> list[str]:
    """One key per row, ``{record key}_{i}`` for the ``i``-th row of its rollout (verl's
    ``{uid}_{session}_{index}``)."""
    seen: dict[str, int] = {}
    keys = []
    for rid in rollout_ids:
        index = seen.get(rid, 0)
        seen[rid] = index + 1
        keys.append(f"{record_keys[rid]}_{index}")
    return keys


def new_uid() -> str:
    import uuid

    return str(uuid.uuid4())


def _objects(values: Sequence[Any]) -> Any:
    import numpy as np

    array = np.empty(len(values), dtype=object)
    array[:] = list(values)
    return array


def _endpoint(address: str) -> str:
    """A replica address (``host:port``) as the OpenAI base URL the gateway registers."""
    return address if address.startswith(("http://", "https://")) else f"http://{address}/v1"


def trainer_class(mode: str) -> type:
    """:class:`AglTrainer` over the trainer verl registered for ``trainer.v1.trainer_mode`` ``mode``."""
    verl_trainer = get_trainer_cls(mode)
    return type(f"Agl{verl_trainer.__name__}", (AglTrainer, verl_trainer), {"__module__": __name__})
