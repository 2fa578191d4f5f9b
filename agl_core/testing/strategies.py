"""Hypothesis strategies for realistic multi-turn traces.

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
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from agl_core.stages.aggregation import AggregationSettings
from agl_core.data import CompletedRollout, Triplet

__all__ = [
    "CONTRACT_SETTINGS",
    "TOY_TOKENIZER",
    "ToyTokenizer",
    "aggregation_settings",
    "completed_rollouts",
    "distinct_ids",
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
