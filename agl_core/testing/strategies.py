"""Hypothesis strategies for realistic multi-turn traces, the rows estimators read, and loss inputs.

A trace is what an agent leaves behind: calls whose prompts usually extend the previous context
(prompt + response) with an observation, and sometimes do not — the history was re-rendered and
retokenized, the chat template rewrote the previous turn, or the agent started over. Responses may
be empty or long, log-probs may be missing, prompts may exceed the limits.

Rollout and group ids are uuids, as the trainer makes them, in no particular order: a plugin that
sorts its input, or relies on ids sorting like the input, meets that here.

Retokenization needs a tokenizer in which one text has several tokenizations: :class:`ToyTokenizer`
is a character tokenizer with a few two-character tokens. A model may emit any ids; the agent's
re-rendered history is encoded canonically (greedy longest match), so the two disagree exactly
where a real byte-level BPE model's output does.

:func:`grouped_rows` draws what an advantage estimator reads: groups of rollouts, each rollout one
or more rows (a broken trajectory, transition rows) of merged calls with untrained observation
tokens between them, in shuffled order, rewards often tied within a group. :func:`loss_batches`
draws one policy-loss call's inputs (:class:`LossBatch`), with NaN in some padded positions.
"""

from __future__ import annotations

from agl_core.testing import hypothesis_missing

try:
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
except ModuleNotFoundError as exc:
    raise hypothesis_missing(__name__) from exc

from typing import Any

import attrs
import numpy as np

from agl_core.data import CompletedRollout, TrainingRow, Triplet
from agl_core.stages.advantage import AdvantageSettings
from agl_core.stages.aggregation import AggregationSettings

__all__ = [
    "CONTRACT_SETTINGS",
    "TOY_TOKENIZER",
    "LossBatch",
    "ToyTokenizer",
    "advantage_settings",
    "aggregation_settings",
    "completed_rollouts",
    "distinct_ids",
    "grouped_rows",
    "loss_batches",
    "loss_settings",
    "rollout_batches",
    "token_ids",
]


class ToyTokenizer:
    """Characters plus a few two-character tokens; ``encode`` is canonical, ``decode`` exact."""

    CHARACTERS = "abcdefgh <>/:\n"
    PAIRS = ("ab", "cd", "ef", "gh", "a ", "</", ">\n", "::")

    def __init__(self) -> None:
        self.vocab = list(self.CHARACTERS) + list(self.PAIRS)
        self.ids = {text: i for i, text in enumerate(self.vocab)}

    def __len__(self) -> int:
        return len(self.vocab)

    def decode(self, ids: Any) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            pair = self.ids.get(text[i : i + 2]) if i + 1 < len(text) else None
            if pair is not None:
                out.append(pair)
                i += 2
            else:
                out.append(self.ids[text[i]])
                i += 1
        return out


#: The tokenizer of every generated trace (and of :func:`aggregation_settings`).
TOY_TOKENIZER = ToyTokenizer()

# How the next prompt relates to the previous call, and how often (by repetition).
NEXT_PROMPT = ("observation",) * 4 + ("continue", "retokenized", "template", "break")


def token_ids(min_size: int = 0, max_size: int = 8) -> st.SearchStrategy[list[int]]:
    """Ids a model could emit: any token of :data:`TOY_TOKENIZER`, often the single characters
    ``a b c d`` whose neighbours the tokenizer would merge (a non-canonical tokenization)."""
    token = st.one_of(st.integers(0, len(TOY_TOKENIZER) - 1), st.integers(0, 3))
    return st.lists(token, min_size=min_size, max_size=max_size)


def _lengths_short_or_long(short: int, long: int) -> st.SearchStrategy[tuple[int, int]]:
    """Mostly short sequences, sometimes long enough to cross the limits."""
    return st.one_of(st.just((0, short)), st.just((0, short)), st.just((short, long)))


@st.composite
def _response(draw: st.DrawFn) -> tuple[list[int], list[float] | None]:
    low, high = draw(_lengths_short_or_long(6, 40))
    ids = draw(token_ids(low, high))
    log_probs = draw(
        st.one_of(
            st.none(),
            st.lists(st.floats(-20.0, 0.0, allow_nan=False), min_size=len(ids), max_size=len(ids)),
        )
    )
    return ids, log_probs


@st.composite
def _next_prompt(draw: st.DrawFn, prompt: list[int], response: list[int]) -> list[int]:
    kind = draw(st.sampled_from(NEXT_PROMPT))
    encode, decode = TOY_TOKENIZER.encode, TOY_TOKENIZER.decode
    observation = encode(draw(st.text(TOY_TOKENIZER.CHARACTERS, max_size=12)))
    if kind == "observation":
        return prompt + response + encode("<a>") + observation + encode("</a>\n")
    if kind == "continue":
        return prompt + response + observation
    if kind == "retokenized":
        return encode(decode(prompt + response)) + observation
    if kind == "template":
        return prompt + encode("<h>" + decode(response)[::-1] + "</h>") + observation
    low, high = draw(_lengths_short_or_long(10, 60))
    return draw(token_ids(low, high))


@st.composite
def completed_rollouts(
    draw: st.DrawFn, rollout_id: str = "rollout-0", group_id: str = "group-0", max_calls: int = 5
) -> CompletedRollout:
    """One succeeded rollout of 0..``max_calls`` calls with a final reward."""
    n_calls = draw(st.integers(0, max_calls))
    low, high = draw(_lengths_short_or_long(12, 70))
    prompt = draw(token_ids(low, high))
    calls = []
    for index in range(n_calls):
        response, log_probs = draw(_response())
        reward = draw(st.one_of(st.none(), st.floats(-1.0, 1.0, allow_nan=False)))
        calls.append(Triplet(prompt_ids=prompt, response_ids=response, response_log_probs=log_probs, reward=reward))
        if index + 1 < n_calls:
            prompt = draw(_next_prompt(prompt, response))
    return CompletedRollout(
        rollout_id=rollout_id,
        group_id=group_id,
        state="succeeded",
        triplets=calls,
        final_reward=draw(st.floats(-1.0, 1.0, allow_nan=False)),
    )


def distinct_ids(n: int) -> st.SearchStrategy[list[str]]:
    """``n`` distinct uuid strings in random order (never sorted on purpose)."""
    return st.lists(st.uuids().map(str), min_size=n, max_size=n, unique=True).flatmap(st.permutations)


@st.composite
def rollout_batches(draw: st.DrawFn, max_rollouts: int = 4, max_calls: int = 5) -> list[CompletedRollout]:
    """A batch of rollouts with distinct uuid ids in random order, a few sharing one of two groups."""
    n = draw(st.integers(1, max_rollouts))
    group_ids = draw(distinct_ids(2))
    return [
        draw(completed_rollouts(rollout_id, draw(st.sampled_from(group_ids)), max_calls=max_calls))
        for rollout_id in draw(distinct_ids(n))
    ]


def aggregation_settings(tokenizer: Any = TOY_TOKENIZER) -> st.SearchStrategy[AggregationSettings]:
    """Limits small enough that drops and truncation are common, with and without a tokenizer."""
    return st.builds(
        AggregationSettings,
        max_prompt_length=st.integers(4, 120),
        max_response_length=st.integers(2, 120),
        max_total_length=st.none() | st.integers(4, 200),
        tokenizer=st.sampled_from([None, tokenizer]),
        mismatch_sample_size=st.integers(0, 4),
        mismatch_max_length=st.integers(1, 40),
    )


# The settings every contract property runs under: no deadline (the first call of a plugin may import
# heavy modules), and none of the health checks a contract trips by design — one test method runs for
# every subclass (every plugin), with generated inputs that can be large.
CONTRACT_SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.differing_executors],
)


# Rewards: often one of a few values, so groups with tied or all-equal rewards are common.
REWARDS = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(-2.0, 2.0, allow_nan=False, width=32))


@st.composite
def _rollout_rows(draw: st.DrawFn, rollout_id: str, group_id: str, max_rows: int) -> list[TrainingRow]:
    """A rollout's rows: each merges 1-3 consecutive calls, each call its observation (untrained,
    none for the row's first call) then its response; a row's first call trains at least one token."""
    reward = draw(REWARDS)
    rows, call = [], 0
    for _ in range(draw(st.integers(1, max_rows))):
        mask: list[int] = []
        turns: list[int] = []
        turn_rewards = []
        n_calls = draw(st.integers(1, 3))
        for k in range(n_calls):
            observation, response = (
                (0, draw(st.integers(1, 4))) if k == 0 else (draw(st.integers(0, 3)), draw(st.integers(0, 4)))
            )
            mask += [0] * observation + [1] * response
            turns += [call + k] * (observation + response)
            turn_rewards.append(draw(st.one_of(st.none(), REWARDS)))
        rows.append(
            TrainingRow(
                prompt_ids=[1],
                response_ids=np.arange(len(mask)) % len(TOY_TOKENIZER),
                response_mask=mask,
                reward=reward,
                rollout_id=rollout_id,
                group_id=group_id,
                turn_index=call,
                response_turns=turns,
                turn_rewards=tuple(turn_rewards),
            )
        )
        call += n_calls + draw(st.integers(0, 1))  # sometimes a call between rows is in no row
    return rows


@st.composite
def grouped_rows(
    draw: st.DrawFn,
    min_group_size: int = 1,
    max_groups: int = 3,
    max_group_size: int = 4,
    max_rows_per_rollout: int = 3,
) -> list[TrainingRow]:
    """Rows of 1..``max_groups`` groups of ``min_group_size``..``max_group_size`` rollouts (uuid
    ids), every rollout 1..``max_rows_per_rollout`` rows sharing its group and reward, all shuffled."""
    sizes = draw(
        st.lists(st.integers(min_group_size, max(min_group_size, max_group_size)), min_size=1, max_size=max_groups)
    )
    group_ids = draw(distinct_ids(len(sizes)))
    rollout_ids = iter(draw(distinct_ids(sum(sizes))))
    rows = []
    for group_id, size in zip(group_ids, sizes):
        for _ in range(size):
            rows += draw(_rollout_rows(next(rollout_ids), group_id, max_rows_per_rollout))
    return draw(st.permutations(rows))


def advantage_settings() -> st.SearchStrategy[AdvantageSettings]:
    """Std normalisation on or off; ``gamma`` often 1 (no discount), else anywhere in [0, 1]."""
    return st.builds(
        AdvantageSettings, norm_adv_by_std=st.booleans(), gamma=st.one_of(st.just(1.0), st.floats(0.0, 1.0))
    )


@attrs.frozen(eq=False)
class LossBatch:
    """One policy-loss call's inputs as float64 numpy arrays ``[rows, width]``, right-padded.

    Positions where ``response_mask`` is 0 (observations and padding) hold arbitrary values, NaN
    among them: they must reach neither the loss nor its gradient. ``log_prob`` is the policy's
    (the tensor the loss is differentiated by), ``old_log_prob`` the rollout-time one.
    """

    old_log_prob: np.ndarray
    log_prob: np.ndarray
    advantages: np.ndarray
    response_mask: np.ndarray
    rollout_is_weights: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.response_mask.sum())


def _matrix(draw: st.DrawFn, shape: tuple[int, int], values: st.SearchStrategy[float]) -> np.ndarray:
    return np.array(
        draw(st.lists(values, min_size=shape[0] * shape[1], max_size=shape[0] * shape[1])), dtype=np.float64
    ).reshape(shape)


@st.composite
def loss_batches(draw: st.DrawFn, max_rows: int = 6, max_width: int = 10) -> LossBatch:
    """Inputs with ratios ``exp(log_prob - old_log_prob)`` on both sides of every clip bound (often
    exactly 1), advantages of both signs (often 0), and optional importance weights."""
    shape = (draw(st.integers(1, max_rows)), draw(st.integers(1, max_width)))
    mask = _matrix(draw, shape, st.sampled_from([0.0, 1.0, 1.0])).astype(np.int8)
    mask[:, 0] = 1  # every row trains something (a row without trained tokens never reaches a loss)
    old = _matrix(draw, shape, st.floats(-6.0, 0.0))
    new = old + _matrix(draw, shape, st.one_of(st.just(0.0), st.floats(-1.5, 1.5)))
    advantages = _matrix(draw, shape, st.one_of(st.just(0.0), st.floats(-2.0, 2.0)))
    weights = _matrix(draw, shape, st.floats(0.1, 2.0)) if draw(st.booleans()) else None
    padding = mask == 0
    for array in (old, new, advantages) + ((weights,) if weights is not None else ()):
        array[padding] = draw(st.sampled_from([np.nan, 0.0, 7.0]))
    return LossBatch(old, new, advantages, mask, weights)


def loss_settings() -> st.SearchStrategy[Any]:
    """:class:`~agl_core.stages.policy_loss.LossSettings` with symmetric or asymmetric clip ratios
    and a dual-clip bound; one data-parallel rank (the contract sets ``batch_num_tokens``)."""
    from agl_core.stages.policy_loss import LossSettings  # torch: only when loss inputs are drawn

    ratio = st.floats(0.05, 0.4)
    return st.builds(
        LossSettings,
        clip_ratio=ratio,
        clip_ratio_low=st.one_of(st.none(), ratio),
        clip_ratio_high=st.one_of(st.none(), ratio),
        clip_ratio_c=st.floats(1.5, 5.0),
    )
