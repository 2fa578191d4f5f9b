"""verl's actor worker group, answered in this process on CPU: verl's trainer code runs unchanged.

verl 0.9.1's trainer calls its actor workers with TensorDicts in the no-padding layout of
``verl.workers.utils.padding.left_right_2_no_padding``: ``compute_log_prob``,
``compute_ref_log_prob`` and ``update_actor``. :class:`LocalActorGroup` answers those calls with a
local model: log-probs and entropy come from :mod:`agl_core.backends.torch.model_ops` and are placed
where verl's engine places them (:func:`engine_layout`), and the update runs verl's own loss function,
``verl.workers.utils.losses.ppo_loss``, per micro-batch (verl's ``prepare_micro_batches``) with the
global batch information verl's FSDP engine gives it (:func:`ppo_mini_batch`). The update's metrics
are merged by verl's ``postprocess_batch_func`` and carry the names verl's ``TrainingWorker`` adds
(:data:`WORKER_METRICS`); what differs from verl's workers is only FSDP itself (one process, the
optimizer stepped here).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDict
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding

from agl_core.backends.torch.model_ops import chosen_log_probs, response_distributions, token_entropy

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


def padded_inputs(data: TensorDict) -> dict[str, torch.Tensor]:
    """The padded model inputs of a no-padding batch (``prompts``, ``responses`` and ``attention_mask``
    stay padded there), as :func:`agl_core.stages.tensorize.tensorize` builds them."""
    attention_mask = data["attention_mask"]
    return {
        "input_ids": torch.cat([data["prompts"], data["responses"]], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0),
        "responses": data["responses"],
    }


def engine_layout(values: torch.Tensor, data: TensorDict) -> torch.Tensor:
    """Response-aligned ``[rows, width]`` values as verl's engine returns them: one jagged sequence per
    row over its unpadded tokens, position ``i`` holding the value for token ``i + 1`` (zeros where
    no response token follows); ``no_padding_2_padding`` takes them back."""
    prompt_width = data["prompts"].shape[1]
    mask = data["attention_mask"]
    pieces = []
    for i in range(values.shape[0]):
        n_prompt, n_response = int(mask[i, :prompt_width].sum()), int(mask[i, prompt_width:].sum())
        pieces.append(torch.cat([values.new_zeros(n_prompt - 1), values[i, :n_response], values.new_zeros(1)]))
    return torch.nested.as_nested_tensor(pieces, layout=torch.jagged)


def model_output(model: torch.nn.Module, data: TensorDict, *, entropy: bool = True) -> dict[str, torch.Tensor]:
    """``log_probs`` (and ``entropy``) of ``model`` on ``data``, in verl's engine layout."""
    inputs = padded_inputs(data)
    distributions = response_distributions(model, inputs)
    output = {"log_probs": engine_layout(chosen_log_probs(distributions, inputs["responses"]), data)}
    if entropy:
        output["entropy"] = engine_layout(token_entropy(distributions), data)
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
    """A padded ``batch`` as one mini-batch reaches verl's engine: converted as the trainer's
    ``_update_actor`` converts it (``left_right_2_no_padding``, ``calculate_entropy``,
    ``global_batch_size``), with :func:`engine_settings`."""
    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(
        data, calculate_entropy=config.calculate_entropy or config.entropy_coeff != 0, global_batch_size=len(batch)
    )
    return engine_settings(data, config)


def ppo_mini_batch(
    config: Any, model: torch.nn.Module, mini: TensorDict, *, dp_size: int = 1, batch_num_tokens: int | None = None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's FSDP engine's ``forward_backward_batch`` on one mini-batch, with ``ppo_loss``: the
    mini-batch's trained tokens (``batch_num_tokens``, over every data-parallel rank: the engine
    all-reduces them) and ``dp_size`` assigned, split into micro-batches, each one's loss
    back-propagated. Returns the summed loss and the metrics merged by verl's
    ``postprocess_batch_func``."""
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


class LocalActorGroup:
    """The actor (and reference) worker group of a ``RayPPOTrainer``, for ``actor_rollout_wg`` and
    ``ref_policy_wg``: ``config`` is verl's ``ActorConfig``, ``optimizer`` steps ``model``."""

    world_size = 1

    def __init__(
        self, model: torch.nn.Module, ref_model: torch.nn.Module | None, config: Any, optimizer: torch.optim.Optimizer
    ):
        self.model, self.ref_model, self.config, self.optimizer = model, ref_model, config, optimizer
        self._dispatch_info = {"actor": [0]}

    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        with torch.no_grad():
            output = model_output(self.model, data)
        return tu.get_tensordict(tensor_dict=output, non_tensor_dict={"metrics": {"mfu": 0.0}})

    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict:
        assert self.ref_model is not None, "no reference model was given"
        with torch.no_grad():
            output = model_output(self.ref_model, data, entropy=False)
        return tu.get_tensordict(tensor_dict=output, non_tensor_dict={"metrics": {}})

    def mini_batches(self, data: TensorDict) -> Iterator[TensorDict]:
        """verl's ``train_mini_batch`` iteration, with ``train_batch``'s engine settings assigned."""
        for mini in tu.make_iterator(
            data,
            mini_batch_size=tu.get(data, "mini_batch_size"),
            epochs=tu.get(data, "epochs"),
            seed=tu.get(data, "seed"),
            dataloader_kwargs=tu.get(data, "dataloader_kwargs"),
        ):
            yield engine_settings(mini, self.config)

    def update_actor(self, data: TensorDict) -> TensorDict:
        """One optimizer step per mini-batch; the metrics of every mini-batch, as verl's worker
        returns them (a list per name)."""
        metrics: dict[str, list[float]] = {}
        for mini in self.mini_batches(data):
            self.optimizer.zero_grad(set_to_none=True)
            loss, mini_metrics = ppo_mini_batch(self.config, self.model, mini)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.clip_grad)
            self.optimizer.step()
            step = {
                k: Metric.aggregate_dp([v]) if isinstance(v, Metric) else sum(v) / len(v)
                for k, v in mini_metrics.items()
            }
            step.update(
                {"loss": float(loss), "grad_norm": float(grad_norm), "lr": self.optimizer.param_groups[0]["lr"]}
            )
            step.update({name: 0.0 for name in WORKER_METRICS if name not in step})
            append_to_dict(metrics, step)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})
