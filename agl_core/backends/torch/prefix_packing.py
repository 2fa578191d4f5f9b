"""The torch backend's prefix-shared forward: packs of rows (:mod:`agl_core.stages.prefix_sharing`)
as one model call.

A micro-batch of packs is one forward pass over the packs right-padded to the longest. A micro-batch
of chains needs no mask: causal attention is a chain's attention, and a real token never attends to
the padding after it, so the attention runs its causal kernel. A micro-batch with a tree gets the
tree mask as a 4-D boolean ``[packs, 1, L, L]`` mask (transformers hands a 4-D mask to the attention
as it is; :func:`~agl_core.backends.ppo.model_attention_mask` gives it the form the
attention implementation applies), padding attending only to itself, and each token's depth
as its position id. Logits are computed only at the columns that predict some row's response token
(``logits_to_keep``), and a row's response token ``t`` reads its log-prob from the token before it in
its pack.

In token-budget micro-batches (:func:`split_shared`) the unit is a pack of rows instead of a row
(:func:`agl_core.backends.micro_batching.split`): the batch's rows are packed, each pack within the
budget, and the packs grouped by the same rule (a pack's length as its size), chains apart from trees
so that only the trees' passes pay for a mask. A micro-batch is then its packs' rows, with the
:class:`~agl_core.backends.micro_batching.PackedForward` that computes them. A pass over trees is also
bounded by ``agentlightning.torch.max_tree_tokens``: its mask has the square of its length in
elements, where a chain needs none.

Models whose attention is not plain causal attention over every layer (sliding-window layers, other
attention implementations) or whose positions are not read from ``position_ids`` alone (no
``position_ids`` argument, alibi, a rope scaled by the pass's longest position) are refused, decided
from what the model computes (:func:`agl_core.backends.torch.checks.position_problem`), not its name:
the mask or the positions would not mean what they compute.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from agl_core.backends.micro_batching import MicroBatch, PackedForward, RowLengths
from agl_core.backends.ppo import attention_implementation
from agl_core.backends.torch.checks import SHARE_KEY, position_problem
from agl_core.config import ConfigError
from agl_core.errors import UsageError
from agl_core.stages.micro_batches import check_budget, micro_batches
from agl_core.stages.prefix_sharing import PackCost, PrefixPacks, prefix_packs

__all__ = ["check_packable", "pack_cost", "packed_forward", "row_packs", "split_shared"]

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def check_packable(model: torch.nn.Module) -> None:
    """Refuse, naming :data:`~agl_core.backends.torch.checks.SHARE_KEY`, a model whose attention a tree
    mask does not describe or whose positions a pack does not compute
    (:func:`~agl_core.backends.torch.checks.position_problem`, the loaded model's forward asked
    whether it takes ``position_ids``)."""
    implementation = attention_implementation(model)
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError(
            SHARE_KEY,
            f"needs the model's attention to be one of {', '.join(ATTENTION_IMPLEMENTATIONS)},"
            f" not {implementation!r}; set {SHARE_KEY}=false",
        )
    model = getattr(model, "module", model)  # a DistributedDataParallel's
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's
    takes_positions = "position_ids" in inspect.signature(type(model).forward).parameters
    problem = position_problem(model.config.to_dict(), takes_positions)
    if problem is not None:
        raise ConfigError(SHARE_KEY, f"cannot share prefixes of {problem}; set {SHARE_KEY}=false")


def pack_cost(model: torch.nn.Module) -> PackCost:
    """The cost of a pack in floating-point operations of its forward pass (the backward's are about
    twice both terms): 2 per weight of every linear layer per token, and 4 per attention head
    dimension per layer for each (query, key) pair (the scores and the weighted sum)."""
    config = model.config.get_text_config()
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return PackCost(per_token=2.0 * weights, per_pair=4.0 * heads * head_dim * int(config.num_hidden_layers))


def row_packs(
    tensors: Mapping[str, torch.Tensor],
    lengths: RowLengths,
    cost: PackCost,
    max_tokens: int | None,
    max_tree_tokens: int | None = None,
) -> PrefixPacks:
    """The packs of a tensorised batch's rows, each within ``max_tokens`` and a tree within
    ``max_tree_tokens``; each row's path from the token before its response on."""
    if (lengths.prompts < 1).any():
        row = int(np.flatnonzero(lengths.prompts < 1)[0])
        raise UsageError(f"row {row} has an empty prompt: no token predicts its first response token")
    prompt_width = tensors["prompts"].shape[1]
    input_ids = tensors["input_ids"].cpu().numpy()
    sequences = [
        input_ids[i, prompt_width - p : prompt_width + r]
        for i, (p, r) in enumerate(zip(lengths.prompts.tolist(), lengths.responses.tolist()))
    ]
    return prefix_packs(
        sequences, cost, max_length=max_tokens, max_tree_length=max_tree_tokens, path_start=lengths.prompts - 1
    )


def packed_forward(
    layout: PrefixPacks, members: Sequence[int], lengths: RowLengths, device: torch.device
) -> tuple[np.ndarray, PackedForward]:
    """The forward pass over the packs ``members`` of ``layout``: its rows (ascending) and its inputs."""
    packs = [layout.packs[m] for m in members]
    rows = np.sort(np.concatenate([p.rows for p in packs]))
    width = max(len(p) for p in packs)
    chains = all(p.is_chain for p in packs)
    input_ids = np.zeros((len(packs), width), np.int64)
    positions = None if chains else np.zeros((len(packs), width), np.int64)
    mask = None if chains else np.zeros((len(packs), 1, width, width), bool)
    for b, pack in enumerate(packs):
        n = len(pack)
        input_ids[b, :n] = pack.tokens
        if mask is not None:
            positions[b, :n] = pack.positions
            padding = np.arange(n, width)
            mask[b, 0, padding, padding] = True  # padding attends to itself, so its values stay finite
            if pack.is_chain:
                mask[b, 0, :n, :n] = np.tri(n, dtype=bool)
            else:
                query = np.arange(n)[:, None]
                mask[b, 0, :n, :n] = (np.arange(n)[None, :] <= query) & (query < pack.subtree_end[None, :])
    # Each row's response token t is predicted at the offset path[t] of its pack.
    pack_of = {m: b for b, m in enumerate(members)}
    row_batch = np.array([pack_of[int(layout.row_pack[r])] for r in rows], np.int64)
    row_paths = [layout.row_paths[r][: lengths.responses[r]] for r in rows]
    keep = np.unique(np.concatenate(row_paths))
    index = np.zeros((len(rows), int(lengths.responses[rows].max())), np.int64)
    for j, (b, path) in enumerate(zip(row_batch.tolist(), row_paths)):
        index[j, : len(path)] = b * len(keep) + np.searchsorted(keep, path)
    return rows, PackedForward(
        input_ids=torch.as_tensor(input_ids, device=device),
        position_ids=None if positions is None else torch.as_tensor(positions, device=device),
        attention_mask=None if mask is None else torch.as_tensor(mask, device=device),
        keep=torch.as_tensor(keep, device=device),
        index=torch.as_tensor(index, device=device),
        n_tokens=sum(len(p) for p in packs),
    )


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
