"""agl's padded batch ↔ verl's ``DataProto``.

The tensors keep :mod:`agl_core.stages.tensorize`'s names, which are verl's (``prompts``, ``responses``,
``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``, ``token_level_scores``,
``rollout_log_probs``). The per-row columns travel as ``non_tensor_batch`` entries, plus ``uid``
(the group id), the key verl's group estimators and batch balancing read. A vision-language batch's
``[rows, 4, L]`` ``position_ids`` and per-row ``multi_modal_inputs`` column are verl's own layout for
them, and travel as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from verl import DataProto

from agl_core import PaddedBatch

GROUP_KEY = "uid"
ROW_COLUMNS = ("rollout_ids", "group_ids", "turn_indices")
OPTIONAL_COLUMNS = ("multi_modal_inputs",)


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
    columns = [*ROW_COLUMNS, *(key for key in OPTIONAL_COLUMNS if key in data.non_tensor_batch)]
    return PaddedBatch(tensors, {key: data.non_tensor_batch[key] for key in columns})
