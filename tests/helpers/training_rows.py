"""Hypothesis strategies for training rows that share prefixes every way an agent's rows do."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from agl_core.data import TrainingRow


@st.composite
def row_sequences(draw, max_rows: int = 10, max_length: int = 120, max_token: int = 999) -> list[np.ndarray]:
    """Token sequences that share prefixes every way rows do: a row that extends another (a
    transition row and its next turn), rows that branch from a common prompt (a GRPO group), a row
    cut short inside another (a truncated response), an exact repeat, and unrelated rows; at most
    ``max_length`` tokens each, ids from 3 to ``max_token``."""
    out: list[np.ndarray] = []
    for _ in range(draw(st.integers(1, max_rows))):
        kind = draw(st.sampled_from(["fresh", "extend", "branch", "cut", "repeat"]))
        tokens = st.lists(st.integers(3, max_token), min_size=1, max_size=24)
        if kind == "fresh" or not out:
            out.append(np.array(draw(tokens) + draw(tokens), np.int64)[:max_length])
            continue
        base = out[draw(st.integers(0, len(out) - 1))]
        if kind == "repeat":
            out.append(base.copy())
        elif kind == "extend":
            out.append(np.concatenate([base, draw(tokens)])[:max_length])
        else:
            keep = draw(st.integers(2, len(base))) if len(base) > 2 else len(base)
            tail = draw(tokens) if kind == "branch" else []
            out.append(np.concatenate([base[:keep], np.array(tail, np.int64)])[:max_length])
    return out


@st.composite
def branching_pair(draw, max_token: int = 999) -> list[np.ndarray]:
    """Two sequences that share a prefix and then differ, rooted at token 2, which
    :func:`row_sequences` never draws: packed with shared prefixes they form a tree of their own, of
    at most 29 tokens, whatever rows come with them."""
    token = st.integers(3, max_token)
    shared = [2, *draw(st.lists(token, min_size=6, max_size=16))]
    first = draw(token)
    second = draw(token.filter(lambda t: t != first))
    # Two tokens a tail at least: the second branch's first token then predicts a token, so what it
    # attends to and where it sits show in the log-probs.
    tails = [
        [first, *draw(st.lists(token, min_size=1, max_size=5))],
        [second, *draw(st.lists(token, min_size=1, max_size=5))],
    ]
    return [np.array(shared + tail, np.int64) for tail in tails]


@st.composite
def training_rows(draw, branching: bool = False, **sequences) -> list[TrainingRow]:
    """Rows over :func:`row_sequences`, each cut into a prompt and a response at a random place, with
    masked observation tokens inside the response and rows of several rollouts and groups;
    ``sequences`` go to :func:`row_sequences`. With ``branching``, the first two rows are a
    :func:`branching_pair`, cut inside their shared prefix."""
    pair = draw(branching_pair(sequences.get("max_token", 999))) if branching else []
    rows = []
    for i, tokens in enumerate(pair + draw(row_sequences(**sequences))):
        if len(tokens) < 2:
            tokens = np.concatenate([tokens, tokens])
        cut = draw(st.integers(1, 7 if i < len(pair) else len(tokens) - 1))
        mask = np.array(draw(st.lists(st.integers(0, 1), min_size=len(tokens) - cut, max_size=len(tokens) - cut)))
        mask[draw(st.integers(0, len(mask) - 1))] = 1  # at least one trained token
        rows.append(
            TrainingRow(
                prompt_ids=tokens[:cut],
                response_ids=tokens[cut:],
                response_mask=mask,
                reward=float(i % 3),
                rollout_id=f"r{i // 2}",
                group_id=f"g{i // 4}",
            )
        )
    return rows
