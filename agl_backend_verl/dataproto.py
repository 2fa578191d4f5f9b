"""agl's padded batch ↔ verl's ``DataProto``, and back to training rows.

The tensors keep :mod:`agl_core.stages.tensorize`'s names, which are verl's (``prompts``, ``responses``,
``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``, ``token_level_scores``,
``rollout_log_probs``). The per-row columns travel as ``non_tensor_batch`` entries, plus ``uid``
(the group id), the key verl's group estimators and batch balancing read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from verl import DataProto

from agl_core import PaddedBatch, TrainingRow

GROUP_KEY = "uid"
ROW_COLUMNS = ("rollout_ids", "group_ids", "turn_indices")


def to_dataproto(batch: PaddedBatch, meta_info: Mapping[str, Any] | None = None) -> DataProto:
    """A ``DataProto`` holding ``batch``'s tensors and columns (the tensors are shared, not copied)."""
    non_tensors = dict(batch.non_tensors)
    non_tensors[GROUP_KEY] = np.array(batch.non_tensors["group_ids"], dtype=object)
    return DataProto.from_dict(tensors=dict(batch.tensors), non_tensors=non_tensors, meta_info=dict(meta_info or {}))


def to_padded_batch(data: DataProto) -> PaddedBatch:
    """The tensors and agl's row columns of ``data`` (verl's extra columns, such as ``uid``, left out)."""
    missing = [key for key in ROW_COLUMNS if key not in data.non_tensor_batch]
    if missing:
        raise KeyError(f"DataProto lacks the row column(s) {missing}; was it built by to_dataproto?")
    tensors = {key: data.batch[key] for key in data.batch.keys()}
    return PaddedBatch(tensors, {key: data.non_tensor_batch[key] for key in ROW_COLUMNS})


def rows_from_dataproto(data: DataProto) -> list[TrainingRow]:
    """The training rows a ``DataProto`` of :func:`to_dataproto` holds (padding removed).

    The reward is the row's summed ``token_level_scores`` (float32, as it is trained on); log-probs
    come back only when the batch has ``rollout_log_probs``. Per-call details that are not tensors
    (``response_turns``, ``turn_rewards``) are not carried by a ``DataProto``.
    """
    batch = to_padded_batch(data)
    tensors = batch.tensors
    prompt_width = tensors["prompts"].shape[1]
    attention = tensors["attention_mask"].bool().cpu().numpy()
    prompts = tensors["prompts"].cpu().numpy()
    responses = tensors["responses"].cpu().numpy()
    response_mask = tensors["response_mask"].cpu().numpy()
    rewards = tensors["token_level_scores"].float().sum(dim=-1).cpu().numpy()
    log_probs = tensors.get("rollout_log_probs")
    log_probs = None if log_probs is None else log_probs.float().cpu().numpy()
    rows = []
    for i in range(len(batch)):
        in_prompt = attention[i, :prompt_width]
        in_response = attention[i, prompt_width:]
        rows.append(
            TrainingRow(
                prompt_ids=prompts[i][in_prompt],
                response_ids=responses[i][in_response],
                response_mask=response_mask[i][in_response],
                log_probs=None if log_probs is None else log_probs[i][in_response],
                reward=float(rewards[i]),
                rollout_id=str(batch.non_tensors["rollout_ids"][i]),
                group_id=str(batch.non_tensors["group_ids"][i]),
                turn_index=int(batch.non_tensors["turn_indices"][i]),
            )
        )
    return rows
