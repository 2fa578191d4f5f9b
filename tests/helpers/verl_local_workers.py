"""verl's worker groups answered in this process on CPU, so that verl's own trainer code runs unchanged
without Ray workers, FSDP or replicas.

verl 0.9.1's V1 trainer hands its worker groups a ``KVBatchMeta`` (keys of rows in TransferQueue);
each data-parallel rank reads its contiguous share of the rows from TransferQueue (verl's
``tqbridge``), and writes what it computed back under the same keys. :class:`LocalActorGroup` and
:class:`LocalCriticGroup` do the same here, through verl's own ``BatchData.chunk`` and ``tqbridge``,
with a local model: log-probs and entropy over each row's whole sequence, laid out as verl's engine
returns them (:func:`model_output`), the actor update with verl's ``ppo_loss`` on the mini-batches
verl's ``TrainingWorker.train_mini_batch`` cuts (``tu.make_iterator``), micro-batched by verl's
``prepare_micro_batches`` with the global batch information verl's FSDP engine gives the loss
(:func:`ppo_mini_batch`; the ranks' gradients averaged, as FSDP does). Every call is recorded in
``calls``, shared with :class:`LocalServing` (the replicas' side: sleep, update_weights), so a
test sees the order of a step. :func:`local_trainer_class` builds the trainer class agl runs for a
mode with these groups in the worker groups' places; :func:`transfer_queue_session` starts
TransferQueue on a local Ray, as verl's task runner does.

:func:`engine_mini_batch` is the legacy trainer's padded layout converted for the engine
(``left_right_2_no_padding``), which ``tests/verl/test_ppo_loss.py`` feeds verl's ``ppo_loss``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl import DataProto
from verl.protocol import BatchData
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.utils.py_functional import append_to_dict
from verl.utils.transferqueue_utils import batch_meta2kv_batch_meta, tqbridge
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches
from verl.workers.utils.losses import ppo_loss, value_loss
from verl.workers.utils.padding import left_right_2_no_padding

from agl_backend_verl.agent_loop import RolloutLoopManager
from agl_backend_verl.run import fit_reports
from agl_backend_verl.trainer import StepReport, trainer_class
from agl_core.backends.ppo import response_stats

# What verl's TrainingWorker adds to the loss function's metrics of every mini-batch
# (verl/workers/engine_workers.py, TrainingWorker._postprocess_output and train_batch): the summed
# micro-batch losses, the gradient norm, the learning rate (last mini-batch), memory and MFU.
WORKER_METRICS = (
    "loss",
    "grad_norm",
    "perf/max_memory_allocated_gb",
    "perf/max_memory_reserved_gb",
    "perf/cpu_memory_used_gb",
    "mfu",
)


# -- model outputs in verl's engine layout -------------------------------------------------------


def padded_inputs(data: TensorDict) -> dict[str, torch.Tensor]:
    """The padded model inputs of a legacy no-padding batch (``prompts``, ``responses`` and
    ``attention_mask`` stay padded there), as :func:`agl_core.stages.tensorize.tensorize` builds them."""
    attention_mask = data["attention_mask"]
    return {
        "input_ids": torch.cat([data["prompts"], data["responses"]], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0),
        "responses": data["responses"],
    }


def engine_layout(values: torch.Tensor, data: TensorDict) -> torch.Tensor:
    """Response-aligned ``[rows, width]`` values of a legacy padded batch as verl's engine returns them:
    one jagged sequence per row over its unpadded tokens, position ``i`` holding the value for token
    ``i + 1`` (zeros where no response token follows); ``no_padding_2_padding`` takes them back."""
    prompt_width = data["prompts"].shape[1]
    mask = data["attention_mask"]
    pieces = []
    for i in range(values.shape[0]):
        n_prompt, n_response = int(mask[i, :prompt_width].sum()), int(mask[i, prompt_width:].sum())
        pieces.append(torch.cat([values.new_zeros(n_prompt - 1), values[i, :n_response], values.new_zeros(1)]))
    return torch.nested.as_nested_tensor(pieces, layout=torch.jagged)


def sequence_outputs(model: torch.nn.Module, data: TensorDict, *, entropy: bool) -> dict[str, torch.Tensor]:
    """``log_probs`` (and ``entropy``) of ``model`` over each row of a TransferQueue batch (nested
    ``input_ids``), as verl's engine returns them: one jagged sequence per row over its prompt and
    response tokens, position ``i`` holding the value for token ``i + 1`` (0 at the last)."""
    rows = list(data["input_ids"].unbind())
    lengths = torch.tensor([len(row) for row in rows])
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=torch.clamp(mask.cumsum(1) - 1, min=0), use_cache=False
    ).logits
    temperature = float(tu.get_non_tensor_data(data, "temperature", 1.0) or 1.0)
    distributions = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)

    def nested(values: torch.Tensor) -> torch.Tensor:
        pieces = [torch.cat([values[i, : n - 1], values.new_zeros(1)]) for i, n in enumerate(lengths.tolist())]
        return torch.nested.as_nested_tensor(pieces, layout=torch.jagged)

    output = {"log_probs": nested(distributions.gather(-1, ids[:, 1:, None]).squeeze(-1))}
    if entropy:
        output["entropy"] = nested(-(distributions.exp() * distributions).sum(-1))
    return output


def model_output(model: torch.nn.Module, data: TensorDict, *, entropy: bool = True) -> dict[str, torch.Tensor]:
    """``log_probs`` (and ``entropy``) of ``model`` on ``data`` in verl's engine layout, for a
    TransferQueue batch (nested rows) or a legacy padded one."""
    if data["prompts"].is_nested:
        return sequence_outputs(model, data, entropy=entropy)
    inputs = padded_inputs(data)
    stats = response_stats(model, inputs)
    output = {"log_probs": engine_layout(stats.log_prob, data)}
    if entropy:
        output["entropy"] = engine_layout(stats.entropy, data)
    return output


def engine_settings(data: TensorDict, config: Any) -> TensorDict:
    """``data`` with the micro-batch settings verl's ``TrainingWorker.train_batch`` adds from the
    actor's engine config (verl's ``ActorConfig`` ``config``)."""
    tu.assign_non_tensor(
        data,
        use_dynamic_bsz=config.use_dynamic_bsz,
        max_token_len_per_gpu=config.ppo_max_token_len_per_gpu,
        micro_batch_size_per_gpu=config.ppo_micro_batch_size_per_gpu,
    )
    return data


def engine_mini_batch(batch: DataProto, config: Any) -> TensorDict:
    """A legacy padded ``batch`` as one mini-batch reached verl's engine from the legacy trainer
    (``left_right_2_no_padding``, ``calculate_entropy``, ``global_batch_size``), with :func:`engine_settings`."""
    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(
        data, calculate_entropy=config.calculate_entropy or config.entropy_coeff != 0, global_batch_size=len(batch)
    )
    return engine_settings(data, config)


def ppo_mini_batch(
    config: Any, model: torch.nn.Module, mini: TensorDict, *, dp_size: int = 1, batch_num_tokens: int | None = None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's FSDP engine's ``forward_backward_batch`` on one rank's share of a mini-batch, with
    ``ppo_loss``: the mini-batch's trained tokens (``batch_num_tokens``, over every data-parallel rank:
    the engine all-reduces them) and ``dp_size`` assigned, split into micro-batches, each one's loss
    back-propagated. Returns the summed loss and the metrics merged by verl's ``postprocess_batch_func``."""
    if batch_num_tokens is None:
        batch_num_tokens = int(mini["loss_mask"].sum())
    tu.assign_non_tensor(mini, batch_num_tokens=batch_num_tokens, dp_size=dp_size)
    micro_batches, indices = prepare_micro_batches(data=mini, dp_group=None, same_micro_num_in_dp=True)
    outputs, total = [], torch.zeros(())
    for micro in micro_batches:
        calculate_entropy = bool(tu.get_non_tensor_data(micro, "calculate_entropy", False))
        loss, metrics = ppo_loss(config, model_output(model, micro, entropy=calculate_entropy), micro)
        loss.backward()
        total = total + loss.detach()
        outputs.append({"loss": loss.item(), "metrics": metrics})
    return total, postprocess_batch_func(outputs, indices, mini)["metrics"]


# -- the worker groups over TransferQueue ----------------------------------------------------------


class Received:
    """What one data-parallel rank was handed: its rows' ``keys`` and ``data`` (fields and extra info)."""

    def __init__(self, keys: list[str], data: TensorDict):
        self.keys, self.data = keys, data


def shares(batch: KVBatchMeta, dp_size: int) -> list[Any]:
    """``batch`` cut as verl's dispatch cuts it: one contiguous share per data-parallel rank."""
    return list(BatchData(batch).chunk(chunks=dp_size))


def received(share: Any) -> Received:
    """A rank's share as verl's ``tqbridge`` hands it to the worker: its rows read from TransferQueue,
    the batch's ``extra_info`` as non-tensor entries."""
    got: list[TensorDict] = []
    tqbridge()(got.append)(share)
    return Received(list(batch_meta2kv_batch_meta(share).keys), got[0])


def answer(share: Any, compute: Any) -> Received:
    """Run ``compute`` on a rank's share as verl's ``tqbridge`` runs a worker method: what it returns is
    written to TransferQueue under the share's keys."""
    seen = received(share)
    tqbridge()(compute)(share)
    return seen


class LocalActorGroup:
    """verl's actor-rollout-ref worker group over ``dp_size`` data-parallel ranks, in this process:
    ``model`` (trained by ``optimizer``) and ``ref_model``, verl's ``ActorConfig`` ``config``.

    ``given[method]`` lists, per call, what each rank received (:class:`Received`); ``optimizer_steps``
    lists, per optimizer step, each rank's mini-batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        ref_model: torch.nn.Module | None,
        config: Any,
        optimizer: torch.optim.Optimizer,
        calls: list[tuple],
        dp_size: int = 1,
    ):
        self.model, self.ref_model, self.config, self.optimizer = model, ref_model, config, optimizer
        self.calls, self.dp_size = calls, dp_size
        self._dispatch_info = {"actor": list(range(dp_size))}
        self.given: dict[str, list[list[Received]]] = {}
        self.optimizer_steps: list[list[TensorDict]] = []

    def _record(self, method: str, batch: KVBatchMeta, seen: list[Received]) -> None:
        self.calls.append((method, len(batch)))
        self.given.setdefault(method, []).append(seen)

    def _forward(self, model: torch.nn.Module, entropy: bool) -> Any:
        def compute(data: TensorDict) -> TensorDict:
            with torch.no_grad():
                output = model_output(model, data, entropy=entropy)
            return TensorDict(output, batch_size=len(data))

        return compute

    def compute_log_prob(self, batch: KVBatchMeta) -> KVBatchMeta:
        compute = self._forward(self.model, entropy=True)
        self._record("compute_log_prob", batch, [answer(share, compute) for share in shares(batch, self.dp_size)])
        return batch

    def compute_ref_log_prob(self, batch: KVBatchMeta) -> KVBatchMeta:
        assert self.ref_model is not None, "no reference model was given"
        compute = self._forward(self.ref_model, entropy=False)
        self._record("compute_ref_log_prob", batch, [answer(s, compute) for s in shares(batch, self.dp_size)])
        return batch

    def mini_batches(self, ranks: Sequence[TensorDict]) -> Iterator[list[TensorDict]]:
        """verl's ``train_mini_batch`` iteration on every rank at once (rank ``r`` seeded ``seed + r``),
        with ``train_batch``'s engine settings assigned."""
        first = ranks[0]
        per_rank = tu.get(first, "mini_batch_size") // self.dp_size
        iterators = [
            tu.make_iterator(
                data,
                mini_batch_size=per_rank,
                epochs=tu.get(first, "epochs"),
                seed=tu.get(first, "seed") + rank,
                dataloader_kwargs=tu.get(first, "dataloader_kwargs"),
            )
            for rank, data in enumerate(ranks)
        ]
        for minis in zip(*iterators, strict=True):
            yield [engine_settings(mini, self.config) for mini in minis]

    def update_actor(self, batch: KVBatchMeta) -> TensorDict:
        """One optimizer step per mini-batch (the ranks' gradients averaged, as FSDP averages them);
        the metrics of every mini-batch, as verl's worker returns them (a list per name)."""
        seen = [received(share) for share in shares(batch, self.dp_size)]
        self._record("update_actor", batch, seen)
        metrics: dict[str, list[float]] = {}
        for minis in self.mini_batches([r.data for r in seen]):
            self.optimizer_steps.append(minis)
            self.optimizer.zero_grad(set_to_none=True)
            tokens = sum(int(mini["loss_mask"].values().sum()) for mini in minis)
            losses, rank_metrics = [], []
            for mini in minis:
                loss, mini_metrics = ppo_mini_batch(
                    self.config, self.model, mini, dp_size=self.dp_size, batch_num_tokens=tokens
                )
                losses.append(float(loss))
                rank_metrics.append(mini_metrics)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad /= self.dp_size
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.clip_grad)
            self.optimizer.step()
            step = {
                k: Metric.aggregate_dp([m[k] for m in rank_metrics])
                if isinstance(rank_metrics[0][k], Metric)
                else sum(sum(m[k]) / len(m[k]) for m in rank_metrics) / len(rank_metrics)
                for k in rank_metrics[0]
            }
            step.update(
                {
                    "loss": sum(losses) / len(losses),
                    "grad_norm": float(grad_norm),
                    "lr": self.optimizer.param_groups[0]["lr"],
                }
            )
            step.update({name: 0.0 for name in WORKER_METRICS if name not in step})
            append_to_dict(metrics, step)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0, **kwargs: Any):
        self.calls.append(("save_checkpoint", global_step))

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, **kwargs: Any):
        self.calls.append(("load_checkpoint", local_path))


class LocalCriticGroup:
    """verl's critic worker group in this process: each row's values are ``0.1 × (position + 1)`` over
    its sequence (so gae's advantages differ from its returns), and ``train_mini_batch`` computes
    verl's ``value_loss`` (``config``: verl's ``CriticConfig``) on the whole batch, against
    predictions 0.01 above those values; nothing is trained."""

    def __init__(self, config: Any, calls: list[tuple]):
        self.config, self.calls = config, calls
        self.trained: list[Received] = []

    @staticmethod
    def _values(data: TensorDict) -> TensorDict:
        values = [0.1 * torch.arange(1, len(row) + 1, dtype=torch.float32) for row in data["input_ids"].unbind()]
        return TensorDict({"values": torch.nested.as_nested_tensor(values, layout=torch.jagged)}, batch_size=len(data))

    def infer_batch(self, batch: KVBatchMeta) -> SimpleNamespace:
        self.calls.append(("infer_batch", len(batch)))
        (share,) = shares(batch, 1)
        answer(share, self._values)
        return SimpleNamespace(futures=[])  # verl's trainer waits on the futures

    def train_mini_batch(self, batch: KVBatchMeta) -> SimpleNamespace:
        self.calls.append(("train_mini_batch", len(batch)))
        (share,) = shares(batch, 1)
        seen = received(share)
        self.trained.append(seen)
        data = seen.data
        model_values = [v.detach() + 0.01 for v in self._values(data)["values"].unbind()]
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["response_mask"].values().sum()))
        tu.assign_non_tensor(data, global_batch_size=len(data))
        loss, metrics = value_loss(
            self.config, {"values": torch.nested.as_nested_tensor(model_values, layout=torch.jagged)}, data
        )
        flat = {k: [v.aggregate() if isinstance(v, Metric) else float(v)] for k, v in metrics.items()}
        output = tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {**flat, "mfu": [0.0]}})
        return SimpleNamespace(get=lambda: output)

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0, **kwargs: Any):
        self.calls.append(("critic_save_checkpoint", global_step))

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, **kwargs: Any):
        self.calls.append(("critic_load_checkpoint", local_path))


class LocalServing:
    """verl's LLM server manager and checkpoint-engine manager for local groups: the replicas are
    ``endpoints`` (``host:port`` or OpenAI base URLs) served elsewhere; sleeping, aborting, resuming and
    weight updates are recorded in ``calls``."""

    def __init__(self, endpoints: Sequence[str], calls: list[tuple]):
        self.server_addresses, self.calls = list(endpoints), calls

    def sleep_replicas(self) -> None:
        self.calls.append(("sleep_replicas",))

    def abort_replicas(self, reject_request: bool = False) -> None:
        self.calls.append(("abort_replicas",))

    def resume_generation_replicas(self) -> None:
        self.calls.append(("resume_generation_replicas",))

    def update_weights(self, global_steps: int | None = None) -> dict:
        self.calls.append(("update_weights", global_steps))
        return {}


class LocalWorkers:
    """The local groups a trainer of :func:`local_trainer_class` gets, sharing one ``calls`` log."""

    def __init__(self, actor: LocalActorGroup, serving: LocalServing, critic: LocalCriticGroup | None = None):
        self.actor, self.serving, self.critic = actor, serving, critic
        self.calls = actor.calls

    def names(self) -> list[str]:
        """The recorded calls' names, in order."""
        return [call[0] for call in self.calls]

    def attach(self, trainer: Any) -> None:
        trainer.ref_in_actor = False
        trainer.actor_rollout_wg = trainer.ref_policy_wg = self.actor
        if trainer.use_critic:
            assert self.critic is not None, "the config trains a critic, but no local critic was given"
            trainer.critic_wg = self.critic
        trainer.llm_server_manager = trainer.checkpoint_manager = self.serving
        trainer.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=[])  # rewards come with the rows


def local_workers(config: Any, endpoints: Sequence[str], *, dp_size: int = 1) -> LocalWorkers:
    """:class:`LocalWorkers` for ``config`` (agl's verl config): the policy at
    ``actor_rollout_ref.model.path`` trained with its optimizer settings, a frozen copy of it as the
    reference, a critic when the config trains one, the replicas at ``endpoints``."""
    from verl.trainer.ppo.utils import need_critic
    from verl.utils.config import omega_conf_to_dataclass

    from agl_core.backends.ppo import make_optimizer
    from agl_core.backends.torch.backend import load_policy

    path = str(config.actor_rollout_ref.model.path)
    model = load_policy(path, torch.device("cpu"))
    optimizer = make_optimizer(model, config.actor_rollout_ref.actor.optim)
    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    calls: list[tuple] = []
    ref = load_policy(path, torch.device("cpu"), frozen=True)
    actor = LocalActorGroup(model, ref, actor_config, optimizer, calls, dp_size)
    critic = LocalCriticGroup(omega_conf_to_dataclass(config.critic), calls) if need_critic(config) else None
    return LocalWorkers(actor, LocalServing(endpoints, calls), critic)


def local_trainer_class(mode: str, endpoints: Sequence[str], *, dp_size: int = 1) -> type:
    """The trainer class agl runs for ``trainer.v1.trainer_mode`` ``mode``
    (:func:`agl_backend_verl.trainer.trainer_class`), set up without Ray workers: verl's ``_setup``
    up to the worker groups (tokenizer, dataloaders), then :func:`local_workers` (``trainer.local``)
    in their places, the replicas put to sleep and verl's checkpoint loading, as verl's ``_setup`` ends."""

    def _setup(self: Any) -> None:
        self._init_tokenizer()
        self._init_dataloader()
        self._init_dump_executor()
        self.local = local_workers(self.config, endpoints, dp_size=dp_size)
        self.local.attach(self)
        self.checkpoint_manager.sleep_replicas()
        self._load_checkpoint()

    base = trainer_class(mode)
    return type(f"Local{base.__name__}", (base,), {"_setup": _setup})


def fit_locally(trainer: Any, source: Any, n: int) -> list[StepReport]:
    """``trainer.fit`` with agl's rollout loop over ``source`` (``n`` rollouts per group), as the
    task runner runs it: the steps it reported (the loop, and with it the source, closed after)."""
    loop = RolloutLoopManager.create(source=source, n=n)
    try:
        return list(fit_reports(trainer, loop))
    finally:
        loop.close()


@contextlib.contextmanager
def transfer_queue_session(config: Any) -> Iterator[None]:
    """TransferQueue started with ``config.transfer_queue`` (one storage unit) on the running Ray
    session, or on a local one started here; closed afterwards (and that Ray stopped)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    conf = OmegaConf.merge(config.transfer_queue, {"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    tq.init(conf)
    try:
        yield
    finally:
        tq.close()
        if started:
            ray.shutdown()
