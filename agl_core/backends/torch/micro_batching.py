"""The torch backend's prefix sharing in token-budget micro-batches: :func:`split_shared`.

With prefix sharing the unit is a pack of rows (:mod:`agl_core.backends.torch.prefix_packing`)
instead of a row (:func:`agl_core.backends.micro_batching.split`): the batch's rows are packed, each
pack within the budget, and the packs grouped by the same rule (a pack's length as its size), chains
apart from trees so that only the trees' passes pay for a mask. A micro-batch is then its packs'
rows, with the :class:`~agl_core.backends.torch.prefix_packing.PackedForward` that computes them. A
pass over trees is also bounded by ``agentlightning.torch.max_tree_tokens``: its mask has the square of
its length in elements, where a chain needs none.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from agl_core.backends.micro_batching import MicroBatch, RowLengths
from agl_core.backends.torch.prefix_packing import packed_forward, row_packs
from agl_core.stages.micro_batches import check_budget, micro_batches
from agl_core.stages.prefix_sharing import PackCost

__all__ = ["split_shared"]


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
    return [
        MicroBatch.of(rows, lengths, device, packed)
        for rows, packed in (packed_forward(layout, group, lengths, device) for group in groups)
    ]
