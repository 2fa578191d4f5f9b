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

A vision-language model's batch (``vision``, a :class:`~agl_core.stages.vision.VisionSpec`) differs in
two ways, for every row, text rows too: ``position_ids`` is ``(B, 4, L)`` in verl's layout (row 0
the text positions, rows 1-3 the mrope positions; :func:`~agl_core.stages.vision.batch_position_ids`),
and the non-tensor column ``multi_modal_inputs`` holds each row's vision inputs (``{}`` for a text
row, else ``pixel_values`` and ``image_grid_thw``; :func:`~agl_core.stages.vision.vision_inputs`).
A row with images and no ``vision`` is an error: a text model cannot see them.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from agl_core.data import DataValidationError, TrainingRow
from agl_core.errors import UsageError
from agl_core.stages.vision import VisionSpec, batch_position_ids, vision_inputs

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


_LARGE_BYTES = 4 << 20


def _blank(shape: tuple[int, int], dtype: Any, fill: Any) -> np.ndarray:
    """``fill`` everywhere. Zeros come from fresh zero pages, so padding that is never written costs
    nothing; a large array is mapped directly (anonymous memory, zero-filled), because numpy asks the
    kernel for huge pages there, and finding them can stall the first batch of a run for seconds."""
    size = math.prod(shape)
    nbytes = size * np.dtype(dtype).itemsize
    if nbytes < _LARGE_BYTES:
        return np.zeros(shape, dtype) if fill == 0 else np.full(shape, fill, dtype)
    array = np.frombuffer(mmap.mmap(-1, nbytes), dtype, count=size).reshape(shape)
    if fill != 0:
        array.fill(fill)
    return array


def _pack(arrays: Sequence[np.ndarray], width: int, dtype: Any, fill: Any, *, left: bool = False) -> np.ndarray:
    """``[len(arrays), width]``: each 1-D array in its row, right-aligned when ``left`` (left padding),
    the rest ``fill``. One slice copy per row: cheaper than scattering through a boolean mask."""
    out = _blank((len(arrays), width), dtype, fill)
    for i, a in enumerate(arrays):
        if left:
            out[i, width - len(a) :] = a
        else:
            out[i, : len(a)] = a
    return out


def _check_width(name: str, arrays: Sequence[np.ndarray], width: int) -> None:
    longest = max((len(a) for a in arrays), default=0)
    if longest > width:
        raise UsageError(f"{name}: a row has {longest} tokens, more than the width {width}")


def pad_responses(per_row_arrays: Sequence[Any], width: int, dtype: torch.dtype) -> torch.Tensor:
    """Right-pad response-aligned per-row arrays (advantages, returns...) to ``width`` with zeros."""
    arrays = [np.asarray(a) for a in per_row_arrays]
    _check_width("pad_responses", arrays, width)
    numpy_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    return torch.from_numpy(_pack(arrays, width, numpy_dtype, 0))


def _sequences(
    prompt_lengths: np.ndarray, response_lengths: np.ndarray, prompt_width: int, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """``attention_mask`` and ``position_ids`` of rows whose prompt ends at ``prompt_width`` and whose
    response follows it: 1 / 0, 1, 2... on the row's tokens; 0 / 0 before them, 0 / the last position after."""
    attention = _blank((len(prompt_lengths), width), np.int64, 0)
    positions = _blank((len(prompt_lengths), width), np.int64, 0)
    steps = np.arange(width, dtype=np.int64)
    for i, (p, r) in enumerate(zip(prompt_lengths.tolist(), response_lengths.tolist())):
        start, end = prompt_width - p, prompt_width + r
        attention[i, start:end] = 1
        positions[i, start:end] = steps[: p + r]
        positions[i, end:] = p + r - 1
    return attention, positions


def tensorize(
    rows: Sequence[TrainingRow],
    *,
    pad_token_id: int = 0,
    prompt_length: int | None = None,
    response_length: int | None = None,
    vision: VisionSpec | None = None,
) -> PaddedBatch:
    """Pad ``rows`` into a :class:`PaddedBatch`.

    Rows must be trainable: not ``dropped`` (batch shaping removes those) and with at least one
    trained token (the reward needs a place). ``prompt_length`` / ``response_length`` fix the
    widths instead of deriving them from the batch; a longer row is an error. ``vision``: the
    model's vision spec, for a vision-language model (see the module's docstring).
    """
    if not rows:
        raise UsageError("tensorize: no rows to pad (rows is empty)")
    if vision is None:
        for row in rows:
            if row.image_urls:
                raise UsageError(
                    f"rollout {row.rollout_id!r}: a row has {len(row.image_urls)} image(s), and the model has no "
                    "image processor: a text model cannot see images; train a vision-language model"
                )
    # The reward goes on each row's last trained token: after truncation a row may end on
    # observation tokens, which are never trained. Found in each row's own (unpadded) mask:
    # the same search over the padded batch reads every pad column of every row.
    last_trained = np.empty(len(rows), np.int64)
    for i, row in enumerate(rows):
        if row.dropped:
            raise DataValidationError("dropped", "a dropped row reached tensorisation", row.rollout_id)
        trained = np.flatnonzero(row.response_mask)
        if not len(trained):
            raise DataValidationError("response_mask", "row has no trained token to carry the reward", row.rollout_id)
        last_trained[i] = trained[-1]
    prompts = [row.prompt_ids for row in rows]
    responses = [row.response_ids for row in rows]
    if prompt_length is None:
        prompt_length = padded_width(max(len(p) for p in prompts))
    if response_length is None:
        response_length = padded_width(max(len(r) for r in responses))
    _check_width("prompt_length", prompts, prompt_length)
    _check_width("response_length", responses, response_length)

    prompt_lengths = np.fromiter((len(p) for p in prompts), np.int64, len(prompts))
    response_lengths = np.fromiter((len(r) for r in responses), np.int64, len(responses))
    prompt_ids = torch.from_numpy(_pack(prompts, prompt_length, np.int64, pad_token_id, left=True))
    response_ids = torch.from_numpy(_pack(responses, response_length, np.int64, pad_token_id))
    input_ids = _blank((len(rows), prompt_length + response_length), np.int64, pad_token_id)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        input_ids[i, prompt_length - len(prompt) : prompt_length] = prompt
        input_ids[i, prompt_length : prompt_length + len(response)] = response
    attention_mask, position_ids = _sequences(
        prompt_lengths, response_lengths, prompt_length, prompt_length + response_length
    )
    response_mask = _pack([row.response_mask for row in rows], response_length, np.int64, 0)
    log_probs = [row.log_probs for row in rows]

    scores = _blank((len(rows), response_length), np.float32, 0)
    scores[np.arange(len(rows)), last_trained] = [row.reward for row in rows]

    tensors = {
        "prompts": prompt_ids,
        "responses": response_ids,
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention_mask),
        "position_ids": torch.from_numpy(position_ids),
        "response_mask": torch.from_numpy(response_mask),
        "token_level_scores": torch.from_numpy(scores),
    }
    if all(lp is not None for lp in log_probs):
        tensors["rollout_log_probs"] = torch.from_numpy(_pack(log_probs, response_length, np.float32, 0.0))
    non_tensors = {
        "rollout_ids": np.array([row.rollout_id for row in rows], dtype=object),
        "group_ids": np.array([row.group_id for row in rows], dtype=object),
        "turn_indices": np.array([row.turn_index for row in rows], dtype=np.int64),
    }
    if vision is not None:
        inputs = vision_inputs(rows, vision)
        grids = [row_inputs.get("image_grid_thw") for row_inputs in inputs]
        tensors["position_ids"] = batch_position_ids(tensors["input_ids"], tensors["attention_mask"], grids, vision)
        column = np.empty(len(rows), dtype=object)
        for i, row_inputs in enumerate(inputs):
            column[i] = row_inputs
        non_tensors["multi_modal_inputs"] = column
    return PaddedBatch(tensors, non_tensors)
