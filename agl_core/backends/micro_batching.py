"""The rows a backend's update passes compute, below every backend: a tensorised batch cut into
micro-batches, each padded only to its own widths, and the rows an optimizer step trains.

:func:`split` groups the batch's rows into token-budget micro-batches (verl's ``actor.use_dynamic_bsz``)
with :func:`agl_core.stages.micro_batches.micro_batches`, :func:`split_rows` by a number of rows
(:func:`row_groups`), and :meth:`MicroBatch.cut` takes a group's rows out of the batch's tensors,
keeping only the columns its longest prompt and response reach. In
:func:`agl_core.stages.tensorize.tensorize`'s layout prompts are left-padded and responses
right-padded, so the columns cut away hold only padding, and the result equals tensorising the
group's rows with those widths. A response-aligned tensor of the batch (old log-probs, advantages) is
cut alike (:meth:`MicroBatch.cut_responses`), and what a pass computes on a micro-batch goes back into
the batch's width at its rows and first ``response_length`` columns (:func:`batch_results`).

Vision-language rows cut the same way: their ``(B, 4, L)`` position ids along the last dimension,
their per-row image inputs (:data:`MULTI_MODAL_INPUTS`, or any non-tensor column:
:meth:`MicroBatch.cut_rows`) by row, in the micro-batch's row order, which is the order the forward
concatenates their images in. The torch backend's prefix sharing groups packs of rows instead
(:func:`agl_core.backends.torch.prefix_packing.split_shared`), into the same :class:`MicroBatch` with
the :class:`PackedForward` that computes them.

What an update trains: :class:`UpdateBatch` (rows with their advantages and old and reference
log-probs) and :class:`MiniBatch` (one optimizer step's micro-batches), which
:func:`agl_core.backends.ppo.train_batch` steps on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from agl_core.stages.micro_batches import micro_batches

__all__ = [
    "MULTI_MODAL_INPUTS",
    "MicroBatch",
    "MiniBatch",
    "PackedForward",
    "RowLengths",
    "UpdateBatch",
    "batch_results",
    "row_groups",
    "split",
    "split_rows",
]

MULTI_MODAL_INPUTS = "multi_modal_inputs"
"""The batch entry (beside the tensors) holding each row's image inputs: a numpy object array of dicts,
``{}`` for a text row, else ``pixel_values`` and ``image_grid_thw``."""

# The tensors holding prompt and response side by side; ``prompts`` holds the prompt alone, every other
# tensor is aligned with the responses.
SEQUENCE_TENSORS = frozenset({"input_ids", "attention_mask", "position_ids"})


@attrs.frozen
class PackedForward:
    """One forward pass over packs, and where each of its rows reads its response log-probs."""

    input_ids: torch.Tensor
    """``[packs, L]``, right-padded."""
    position_ids: torch.Tensor | None
    """``[packs, L]``; ``None`` for chains (positions 0, 1, 2...)."""
    attention_mask: torch.Tensor | None
    """``[packs, 1, L, L]`` boolean (True: attend); ``None`` for chains (causal)."""
    keep: torch.Tensor
    """The columns whose logits are computed (``logits_to_keep``), ascending."""
    index: torch.Tensor
    """``[rows, response_len]``: for each row's response token, its row in the flattened
    ``[packs × len(keep)]`` logits (0 past the row's response)."""
    n_tokens: int
    """Tokens computed (the packs' lengths, no padding)."""

    @property
    def n_elements(self) -> int:
        """Tensor elements of the pass, padding included."""
        return self.input_ids.numel()


@attrs.frozen
class RowLengths:
    """Each row's prompt and response lengths in a tensorised batch."""

    prompts: np.ndarray
    responses: np.ndarray

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> RowLengths:
        prompt_width = _prompt_width(tensors)
        attention = tensors["attention_mask"]
        return cls(attention[:, :prompt_width].sum(1).cpu().numpy(), attention[:, prompt_width:].sum(1).cpu().numpy())


@attrs.frozen
class MicroBatch:
    """Rows of a batch (indices, ascending) and the prompt / response widths they are padded to."""

    rows: torch.Tensor
    prompt_length: int
    response_length: int
    packed: PackedForward | None = None
    """The prefix-shared forward pass computing these rows (the torch backend's prefix sharing), else ``None``."""

    @classmethod
    def of(
        cls, rows: np.ndarray, lengths: RowLengths, device: torch.device, packed: PackedForward | None = None
    ) -> MicroBatch:
        """Rows ``rows`` of a batch of ``lengths``, padded to their longest prompt and response."""
        return cls(
            torch.as_tensor(rows, device=device),
            int(lengths.prompts[rows].max()),
            int(lengths.responses[rows].max()),
            packed,
        )

    def cut(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """These rows of ``tensors`` (a tensorised batch), padded only to this micro-batch's widths;
        without the sequence tensors when :attr:`packed` computes the rows."""
        prompt_width = _prompt_width(tensors)
        start, end = prompt_width - self.prompt_length, prompt_width + self.response_length
        out = {}
        for name, value in tensors.items():
            # Columns first (a view), then rows: only the micro-batch's own widths are copied.
            if self.packed is not None and (name == "prompts" or name in SEQUENCE_TENSORS):
                continue
            if name == MULTI_MODAL_INPUTS:
                out[name] = self.cut_rows(value)
            elif name == "prompts":
                out[name] = value[:, start:][self.rows]
            elif name in SEQUENCE_TENSORS:  # the sequence is the last dimension: (B, 4, L) mrope position ids too
                out[name] = value[..., start:end][self.rows]
            else:
                out[name] = self.cut_responses(value)
        return out

    def cut_rows(self, column: np.ndarray) -> np.ndarray:
        """These rows of a per-row non-tensor column (``multi_modal_inputs``, ``rollout_ids``...)."""
        return column[self.rows.cpu().numpy()]

    def cut_responses(self, values: torch.Tensor) -> torch.Tensor:
        """These rows of a response-aligned ``[rows, response_len]`` tensor (advantages, log-probs),
        cut like the responses in :meth:`cut`."""
        return values[:, : self.response_length][self.rows]


def row_groups(rows: Sequence[int], size: int | None) -> list[Sequence[int]]:
    """``rows`` (a mini-batch's, or a process's share of it) in consecutive groups of at most ``size``
    rows (``actor.ppo_micro_batch_size_per_gpu``), whose gradients one optimizer step accumulates;
    ``None``: one group of them all."""
    if size is None:
        return [rows]
    return [rows[start : start + size] for start in range(0, len(rows), size)]


def split(tensors: Mapping[str, torch.Tensor], max_tokens: int, key: str) -> list[MicroBatch]:
    """The batch's rows in micro-batches of at most ``max_tokens`` padded elements; ``key`` names the
    budget in the error for a row longer than it."""
    lengths = RowLengths.of(tensors)
    device = tensors["attention_mask"].device
    return [
        MicroBatch.of(np.asarray(group), lengths, device)
        for group in micro_batches(lengths.prompts, lengths.responses, max_tokens, key=key)
    ]


def split_rows(tensors: Mapping[str, torch.Tensor], size: int | None) -> list[MicroBatch]:
    """The batch's rows in consecutive micro-batches of at most ``size`` rows
    (``actor.ppo_micro_batch_size_per_gpu``; ``None``: one), padded to the batch's widths as the torch
    backend's row micro-batches are (so that a pass computes what it computes on the whole batch)."""
    n_rows, response_width = tensors["responses"].shape
    device = tensors["attention_mask"].device
    return [
        MicroBatch(torch.as_tensor(list(group), device=device), _prompt_width(tensors), response_width)
        for group in row_groups(range(n_rows), size)
    ]


def batch_results(
    tensors: Mapping[str, torch.Tensor],
    micro_batches: Iterable[MicroBatch],
    compute: Callable[[MicroBatch], torch.Tensor],
) -> torch.Tensor:
    """What ``compute`` gives each of ``micro_batches`` (``[its rows, its response width]``: log-probs of
    a pass), put back at its rows of the batch ``tensors`` in the batch's response width, float32 (0
    past each micro-batch's width)."""
    responses = tensors["responses"]
    out = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
    for micro in micro_batches:
        out[micro.rows, : micro.response_length] = compute(micro)
    return out


@attrs.frozen
class UpdateBatch:
    """Rows an update trains, row-aligned, so a mini-batch or micro-batch is the same cut of each."""

    tensors: dict[str, Any]
    """Name → ``[rows, ...]`` tensor (:func:`~agl_core.stages.tensorize.tensorize`'s), and the rows'
    image inputs (:data:`MULTI_MODAL_INPUTS`) if any has one."""
    advantages: torch.Tensor
    old_log_prob: torch.Tensor
    ref_log_prob: torch.Tensor | None = None
    packed: PackedForward | None = None
    """The pass computing these rows with their shared prefixes once (a micro-batch's), else ``None``."""

    @property
    def mask(self) -> torch.Tensor:
        return self.tensors["response_mask"]

    @property
    def computed(self) -> tuple[int, int]:
        """Tensor elements of this batch's forward pass, and the tokens among them that are not padding."""
        if self.packed is not None:
            return self.packed.n_elements, self.packed.n_tokens
        return self.tensors["input_ids"].numel(), int(self.tensors["attention_mask"].sum())

    def rows(self, part: slice | Sequence[int]) -> UpdateBatch:
        """The rows ``part`` (a slice, or row indices), at the batch's widths."""
        return UpdateBatch(
            {k: v[part] for k, v in self.tensors.items()},
            self.advantages[part],
            self.old_log_prob[part],
            None if self.ref_log_prob is None else self.ref_log_prob[part],
        )

    def cut(self, micro: MicroBatch) -> UpdateBatch:
        """The rows of ``micro``, padded only to its widths."""
        return UpdateBatch(
            micro.cut(self.tensors),
            micro.cut_responses(self.advantages),
            micro.cut_responses(self.old_log_prob),
            None if self.ref_log_prob is None else micro.cut_responses(self.ref_log_prob),
            micro.packed,
        )


@attrs.frozen
class MiniBatch:
    """One optimizer step's rows: this process's micro-batches of a mini-batch, and the mini-batch's
    trained tokens over every process (the denominator of its token means)."""

    parts: Sequence[UpdateBatch]
    n_tokens: int


def _prompt_width(tensors: Mapping[str, Any]) -> int:
    """The prompts' padded width: the sequence's less the responses' (``prompts`` may be left out, as
    :func:`~agl_core.backends.ppo.take_rows` leaves it)."""
    return int(tensors["input_ids"].shape[-1] - tensors["responses"].shape[1])
