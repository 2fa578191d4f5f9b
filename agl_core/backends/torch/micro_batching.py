"""A tensorised batch cut into token-budget micro-batches, each padded only to its own widths.

:func:`split` groups the batch's rows with :func:`agl_core.stages.micro_batches.micro_batches` and
:meth:`MicroBatch.cut` takes a group's rows out of the batch's tensors, keeping only the columns its
longest prompt and response reach. In :func:`agl_core.stages.tensorize.tensorize`'s layout prompts are
left-padded and responses right-padded, so the columns cut away hold only padding, and the result
equals tensorising the group's rows with those widths.

With prefix sharing (:func:`split_shared`) the unit is a pack of rows
(:mod:`agl_core.backends.torch.prefix_packing`) instead of a row: the batch's rows are packed, each
pack within the budget, and the packs grouped by the same rule (a pack's length as its size), chains
apart from trees so that only the trees' passes pay for a mask. A micro-batch is then its packs'
rows, with the :class:`~agl_core.backends.torch.prefix_packing.PackedForward` that computes them. A
pass over trees is also bounded by ``agentlightning.torch.max_tree_tokens``: its mask has the square of
its length in elements, where a chain needs none.

Vision-language rows cut the same way: their ``(B, 4, L)`` position ids along the last dimension,
their per-row image inputs (:data:`~agl_core.backends.ppo.MULTI_MODAL_INPUTS`, or any
non-tensor column: :meth:`MicroBatch.cut_rows`) by row, in the micro-batch's row order, which is the
order the forward concatenates their images in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import torch

from agl_core.backends.ppo import MULTI_MODAL_INPUTS
from agl_core.backends.torch.prefix_packing import PackedForward, RowLengths, packed_forward, row_packs
from agl_core.stages.micro_batches import check_budget, micro_batches
from agl_core.stages.prefix_sharing import PackCost

__all__ = ["MicroBatch", "split", "split_shared"]

# The tensors holding prompt and response side by side; ``prompts`` holds the prompt alone, every other
# tensor is aligned with the responses.
SEQUENCE_TENSORS = frozenset({"input_ids", "attention_mask", "position_ids"})


@attrs.frozen
class MicroBatch:
    """Rows of a batch (indices, ascending) and the prompt / response widths they are padded to."""

    rows: torch.Tensor
    prompt_length: int
    response_length: int
    packed: PackedForward | None = None
    """The prefix-shared forward pass computing these rows (:func:`split_shared`), else ``None``."""

    def cut(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """These rows of ``tensors`` (a tensorised batch), padded only to this micro-batch's widths;
        without the sequence tensors when :attr:`packed` computes the rows."""
        prompt_width = tensors["prompts"].shape[1]
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


def split(tensors: Mapping[str, torch.Tensor], max_tokens: int, key: str) -> list[MicroBatch]:
    """The batch's rows in micro-batches of at most ``max_tokens`` padded elements; ``key`` names the
    budget in the error for a row longer than it."""
    lengths = RowLengths.of(tensors)
    device = tensors["attention_mask"].device
    return [
        _micro_batch(np.asarray(group), None, lengths, device)
        for group in micro_batches(lengths.prompts, lengths.responses, max_tokens, key=key)
    ]


def split_shared(
    tensors: Mapping[str, torch.Tensor],
    max_tokens: int | None,
    key: str,
    cost: PackCost,
    max_tree_tokens: int | None = None,
) -> list[MicroBatch]:
    """The batch's rows packed with their shared prefixes computed once, in micro-batches of at most
    ``max_tokens`` padded elements (``None``: no bound), chains apart from trees; ``key`` names the
    budget in the error for a row longer than it. A tree pack holds at most ``max_tree_tokens`` tokens
    and so does a pass over trees, which bounds its mask (and the scores of an attention that cannot
    skip masked pairs) to ``max_tree_tokens`` squared elements (``None``: no bound)."""
    lengths = RowLengths.of(tensors)
    if max_tokens is not None:
        check_budget(lengths.prompts, lengths.responses, max_tokens, key=key)
    layout = row_packs(tensors, lengths, cost, max_tokens, max_tree_tokens)
    groups = []
    for chains in (True, False):
        members = [i for i, p in enumerate(layout.packs) if p.is_chain == chains]
        bounds = [max_tokens] if chains else [max_tokens, max_tree_tokens]
        bound = min((b for b in bounds if b is not None), default=None)
        if bound is None:
            groups += [members] if members else []
            continue
        sizes = np.array([len(layout.packs[i]) for i in members], np.int64)
        groups += [[members[j] for j in g] for g in micro_batches(0 * sizes, sizes, bound, key=key)]
    device = tensors["attention_mask"].device
    return [_micro_batch(*packed_forward(layout, group, lengths, device), lengths, device) for group in groups]


def _micro_batch(
    rows: np.ndarray, packed: PackedForward | None, lengths: RowLengths, device: torch.device
) -> MicroBatch:
    return MicroBatch(
        torch.as_tensor(rows, device=device),
        int(lengths.prompts[rows].max()),
        int(lengths.responses[rows].max()),
        packed,
    )
