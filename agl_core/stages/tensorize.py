"""Training rows → a padded batch of torch tensors in verl's layout, for any backend.

Prompts are left-padded and responses right-padded, so every row's prompt ends and its response
starts at the same column. By default both are padded to the batch's longest prompt / response
rounded up to a multiple of 8 (padding to the configured maxima wastes most of the batch on pad
tokens); a backend that needs fixed shapes passes ``prompt_length`` / ``response_length``.

Tensors: ``prompts``, ``responses``, ``input_ids`` (both side by side), ``attention_mask``,
``position_ids`` (``cumsum(attention_mask) - 1`` clamped at 0), ``response_mask`` (1 on trained
tokens), ``token_level_scores`` (float32, the row's reward on its last trained token) and, only
when every row has them, ``rollout_log_probs`` (float32). Non-tensor columns: ``rollout_ids``,
``group_ids`` (numpy object arrays) and ``turn_indices`` (int64).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from agl_core.data import DataValidationError, TrainingRow

__all__ = ["PaddedBatch", "pad_responses", "padded_width", "tensorize"]

PAD_MULTIPLE = 8


@attrs.frozen
class PaddedBatch:
    """A backend-ready batch: ``tensors`` (name → ``[rows, ...]`` tensor) and per-row columns."""

    tensors: dict[str, torch.Tensor]
    non_tensors: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.non_tensors["rollout_ids"])


def padded_width(longest: int, multiple: int = PAD_MULTIPLE) -> int:
    """``longest`` rounded up to a multiple of ``multiple`` (at least one multiple)."""
    return max(multiple, -(-longest // multiple) * multiple)


def _filled(arrays: Sequence[np.ndarray], width: int, left: bool) -> np.ndarray:
    """``[len(arrays), width]`` booleans: where each row's values go once padded."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    columns = np.arange(width)
    return columns >= (width - lengths)[:, None] if left else columns < lengths[:, None]


def _pack(arrays: Sequence[np.ndarray], filled: np.ndarray, dtype: Any, fill: Any) -> np.ndarray:
    """Place each 1-D array in its row of ``filled``'s shape, padded with ``fill``."""
    out = np.full(filled.shape, fill, dtype=dtype)
    if any(len(a) for a in arrays):
        out[filled] = np.concatenate(arrays)
    return out


def _check_width(name: str, arrays: Sequence[np.ndarray], width: int) -> None:
    longest = max((len(a) for a in arrays), default=0)
    if longest > width:
        raise ValueError(f"{name}: a row has {longest} tokens, more than the width {width}")


def pad_responses(per_row_arrays: Sequence[Any], width: int, dtype: torch.dtype) -> torch.Tensor:
    """Right-pad response-aligned per-row arrays (advantages, returns...) to ``width`` with zeros."""
    arrays = [np.asarray(a) for a in per_row_arrays]
    _check_width("pad_responses", arrays, width)
    numpy_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    return torch.from_numpy(_pack(arrays, _filled(arrays, width, left=False), numpy_dtype, 0))


def tensorize(
    rows: Sequence[TrainingRow],
    *,
    pad_token_id: int = 0,
    prompt_length: int | None = None,
    response_length: int | None = None,
) -> PaddedBatch:
    """Pad ``rows`` into a :class:`PaddedBatch`.

    Rows must be trainable: not ``dropped`` (batch shaping removes those) and with at least one
    trained token (the reward needs a place). ``prompt_length`` / ``response_length`` fix the
    widths instead of deriving them from the batch; a longer row is an error.
    """
    if not rows:
        raise ValueError("tensorize: no rows to pad")
    for row in rows:
        if row.dropped:
            raise DataValidationError("dropped", "a dropped row reached tensorisation", row.rollout_id)
        if not row.response_mask.any():
            raise DataValidationError("response_mask", "row has no trained token to carry the reward", row.rollout_id)
    prompts = [row.prompt_ids for row in rows]
    responses = [row.response_ids for row in rows]
    if prompt_length is None:
        prompt_length = padded_width(max(len(p) for p in prompts))
    if response_length is None:
        response_length = padded_width(max(len(r) for r in responses))
    _check_width("prompt_length", prompts, prompt_length)
    _check_width("response_length", responses, response_length)

    prompt_filled = _filled(prompts, prompt_length, left=True)
    response_filled = _filled(responses, response_length, left=False)
    prompt_ids = torch.from_numpy(_pack(prompts, prompt_filled, np.int64, pad_token_id))
    response_ids = torch.from_numpy(_pack(responses, response_filled, np.int64, pad_token_id))
    attention_mask = torch.from_numpy(np.concatenate([prompt_filled, response_filled], axis=1).astype(np.int64))
    response_mask = torch.from_numpy(_pack([row.response_mask for row in rows], response_filled, np.int64, 0))
    log_probs = [row.log_probs for row in rows]

    # The reward goes on each row's last trained token: after truncation a row may end on
    # observation tokens, which are never trained.
    last_trained = response_length - 1 - torch.argmax(torch.flip(response_mask, dims=[1]), dim=1)
    scores = torch.zeros((len(rows), response_length), dtype=torch.float32)
    rewards = torch.tensor([row.reward for row in rows], dtype=torch.float32)
    scores[torch.arange(len(rows)), last_trained] = rewards

    tensors = {
        "prompts": prompt_ids,
        "responses": response_ids,
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0),
        "response_mask": response_mask,
        "token_level_scores": scores,
    }
    if all(lp is not None for lp in log_probs):
        tensors["rollout_log_probs"] = torch.from_numpy(_pack(log_probs, response_filled, np.float32, 0.0))
    non_tensors = {
        "rollout_ids": np.array([row.rollout_id for row in rows], dtype=object),
        "group_ids": np.array([row.group_id for row in rows], dtype=object),
        "turn_indices": np.array([row.turn_index for row in rows], dtype=np.int64),
    }
    return PaddedBatch(tensors, non_tensors)
