"""Prefix sharing: rows laid out so that a token several rows start with is computed once.

The rows of one GRPO group share their prompt; the transition rows of one rollout share the whole
conversation before each turn (row k's prompt + response is a prefix of row k+1's prompt). Under
causal attention a token's hidden state depends only on the tokens before it, so two rows that start
with the same tokens have the same hidden states there: computing each shared token once and letting
every row read its log-probs from it gives each row the log-probs it has alone, and the gradient of a
loss over the rows is the same sum.

:func:`prefix_packs` builds the prefix tree (trie) of the rows' token sequences and cuts it into
*packs*, each a sequence holding the union of some rows' tokens in the tree's pre-order: a token
sits at its depth (its position in every row that holds it) and attends to itself and its
ancestors. A pack whose rows all extend one another is a *chain*, and plain causal attention over it
is exactly that; any other pack needs its tree mask: token ``q`` attends to token ``k`` iff
``k <= q < subtree_end[k]`` (pre-order puts a token's descendants right after it).

Rows are taken in lexicographic order of their tokens, which is the tree's pre-order, so rows that
share a prefix are adjacent and each row shares with the row before it the prefix the two have in
common. Where to cut is a cost decision (:class:`PackCost`): sharing saves the shared tokens'
per-token work (the weights' matmuls), but a pack's attention grows with the square of its length,
and a tree pack's mask lets no kernel skip the masked half as a causal one does. A row joins the pack
of the row before it when that adds less cost than a pack of its own would have, and the pack stays
within ``max_length``; a tree pack also within ``max_tree_length``: its mask, and the scores of an
attention that cannot skip masked pairs, grow with the square of its length, where a chain's causal
kernel needs neither.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from agl_core.errors import UsageError
from agl_core.stages.mismatch import common_prefix_length

__all__ = ["Pack", "PackCost", "PrefixPacks", "prefix_packs"]


@attrs.frozen
class PackCost:
    """The work of computing one pack, in any unit: ``per_token`` for each token (the weights'
    matmuls) plus ``per_pair`` for each (query, key) pair its attention computes, half the square of
    its length for a chain (a causal kernel skips the masked half), the whole square for a tree."""

    per_token: float
    per_pair: float

    def __call__(self, n_tokens: int, chain: bool) -> float:
        pairs = n_tokens * n_tokens
        return self.per_token * n_tokens + self.per_pair * (pairs / 2 if chain else pairs)


@attrs.frozen
class Pack:
    """Tokens of some rows, each once, in prefix-tree pre-order."""

    tokens: np.ndarray
    """The token ids (int64)."""
    positions: np.ndarray
    """Each token's position in the rows that hold it (its depth in the tree)."""
    subtree_end: np.ndarray | None
    """For a tree: token ``q`` attends to ``k`` iff ``k <= q < subtree_end[k]``; ``None`` for a chain
    (causal attention)."""
    rows: np.ndarray
    """The rows it holds, ascending."""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.subtree_end is None


@attrs.frozen
class PrefixPacks:
    """The packs of a set of rows and where each row's tokens are in its pack."""

    packs: list[Pack]
    row_pack: np.ndarray
    """The pack of each row."""
    row_paths: list[np.ndarray]
    """For each row, the offsets in its pack of its tokens from ``path_start[row]`` on."""
    path_start: np.ndarray
    """The first position of each row that ``row_paths`` holds (so a caller keeps only what it reads)."""

    @property
    def n_tokens(self) -> int:
        """Tokens computed: the packs' lengths."""
        return sum(len(p) for p in self.packs)


def _sort_key(tokens: np.ndarray) -> bytes:
    """Bytes that sort as ``tokens`` do lexicographically (fixed width per token, big-endian), a
    row before every row it is a prefix of."""
    wide = tokens.min(initial=0) < 0 or tokens.max(initial=0) >= 1 << 32
    return tokens.astype(">i8" if wide else ">u4").tobytes()


class _PackBuilder:
    """One pack, grown a row at a time: its tokens, their depths, and their subtree ends (a stack of
    the segments still open, each ``[depth_start, depth_end)`` of one row, placed from ``offset``)."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.depths: list[np.ndarray] = []
        self.ends: list[tuple[int, int, int]] = []  # (offset, count, end): subtree ends to fill
        self.open: list[list[int]] = []  # [depth_start, depth_end, offset]
        self.rows: list[int] = []
        self.n_tokens = 0
        self.chain = True
        self.last_length = 0
        self.path = np.empty(0, np.int64)

    def add(self, row: int, tokens: np.ndarray, shared: int) -> np.ndarray:
        """Add ``tokens`` (a row) sharing its first ``shared`` tokens with the row added last; the
        offsets of all its tokens."""
        if self.rows and shared < self.last_length:
            self.chain = False
        self._close(shared)
        new = len(tokens) - shared
        start = self.n_tokens
        self.parts.append(tokens[shared:])
        self.depths.append(np.arange(shared, len(tokens), dtype=np.int64))
        if new:
            self.open.append([shared, len(tokens), start])
        self.path = np.concatenate([self.path[:shared], np.arange(start, start + new, dtype=np.int64)])
        self.n_tokens += new
        self.rows.append(row)
        self.last_length = len(tokens)
        return self.path

    def _close(self, depth: int) -> None:
        """Tokens at ``depth`` or deeper on the open path get no more descendants."""
        while self.open and self.open[-1][1] > depth:
            first, last, offset = self.open[-1]
            cut = max(first, depth)
            self.ends.append((offset + cut - first, last - cut, self.n_tokens))
            if cut == first:
                self.open.pop()
            else:
                self.open[-1][1] = cut

    def pack(self) -> Pack:
        self._close(0)
        subtree_end = None
        if not self.chain:
            subtree_end = np.empty(self.n_tokens, np.int64)
            for offset, count, end in self.ends:
                subtree_end[offset : offset + count] = end
        return Pack(
            tokens=np.concatenate(self.parts).astype(np.int64, copy=False),
            positions=np.concatenate(self.depths),
            subtree_end=subtree_end,
            rows=np.sort(np.asarray(self.rows, dtype=np.int64)),
        )


def prefix_packs(
    sequences: Sequence[np.ndarray],
    cost: PackCost,
    *,
    max_length: int | None = None,
    max_tree_length: int | None = None,
    path_start: Sequence[int] | np.ndarray | None = None,
) -> PrefixPacks:
    """Pack ``sequences`` (each row's token ids, prompt then response) as the module docstring says.

    ``max_length`` bounds each pack's tokens (a row longer than it is an error); ``max_tree_length``
    bounds a tree pack's (a row longer than it stays a chain of its own); ``path_start`` (per row,
    default 0) is the first position whose offset the caller needs in ``row_paths``.
    Raises ``ValueError`` for an empty row or one longer than ``max_length``.
    """
    rows = [np.asarray(s) for s in sequences]
    starts = np.zeros(len(rows), np.int64) if path_start is None else np.asarray(path_start, np.int64)
    for i, tokens in enumerate(rows):
        if tokens.ndim != 1 or not len(tokens):
            raise UsageError(f"row {i} has no tokens to pack")
        if max_length is not None and len(tokens) > max_length:
            raise UsageError(f"row {i} has {len(tokens)} tokens, more than a pack may hold ({max_length})")
    order = sorted(range(len(rows)), key=lambda i: _sort_key(rows[i]))
    packs: list[Pack] = []
    row_pack = np.empty(len(rows), np.int64)
    row_paths: list[np.ndarray] = [np.empty(0, np.int64)] * len(rows)
    builder: _PackBuilder | None = None
    previous: np.ndarray | None = None
    for i in order:
        tokens = rows[i]
        shared = 0 if previous is None else common_prefix_length(previous, tokens)
        previous = tokens
        if builder is not None and not _joins(builder, len(tokens), shared, cost, max_length, max_tree_length):
            packs.append(builder.pack())
            builder = None
        if builder is None:
            builder, shared = _PackBuilder(), 0
        path = builder.add(i, tokens, shared)
        row_pack[i] = len(packs)
        row_paths[i] = path[starts[i] :].copy()
    if builder is not None:
        packs.append(builder.pack())
    return PrefixPacks(packs, row_pack, row_paths, starts)


def _joins(
    pack: _PackBuilder, length: int, shared: int, cost: PackCost, max_length: int | None, max_tree_length: int | None
) -> bool:
    """Whether a row of ``length`` tokens sharing ``shared`` with the pack's last row costs less in the
    pack than in one of its own, and the pack stays within its bounds."""
    if shared == 0:
        return False
    grown = pack.n_tokens + length - shared
    if max_length is not None and grown > max_length:
        return False
    chain = pack.chain and shared == pack.last_length
    if not chain and max_tree_length is not None and grown > max_tree_length:
        return False
    return cost(grown, chain) - cost(pack.n_tokens, pack.chain) <= cost(length, True)
