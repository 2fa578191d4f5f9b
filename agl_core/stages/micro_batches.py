"""Token-budget micro-batches: rows grouped so that each group, padded only to its own longest prompt
and longest response, holds at most a budget of tensor elements.

verl's dynamic batch size (``actor_rollout_ref.actor.use_dynamic_bsz`` with
``ppo_max_token_len_per_gpu``, and for the log-prob passes ``rollout.log_prob_*`` and
``ref.log_prob_*``) bounds the tokens of each forward pass instead of its number of rows. A backend
that pads (no sequence packing) pays for every padded element, so here the budget bounds the padded
size: a group of ``n`` rows whose longest prompt is ``P`` and longest response ``R`` costs
``n × (P + R)`` elements, never more than the budget.

Greedy, longest first: each group starts from the longest row left (prompt + response; ties in
input order) and takes, one at a time, the row left that adds the fewest padding elements (its own
padding plus the widening of the group's) while the group stays within the budget; a group is done
when no row left fits. Both widths of a group then stay close to its rows' lengths, whether prompts
and responses grow together or not (padded/real about 1.0-1.1 on multi-turn workloads at verl's
default budget, against 1.5-2.5 for one batch padded to its longest row). A row that alone
exceeds the budget is an error naming the budget's key (the config check asks for a budget of at
least the longest row the aggregation limits let through, so a validated run never meets one).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agl_core.errors import UsageError
from agl_core.fields import is_int

__all__ = ["check_budget", "micro_batches", "padded_elements"]


def _lengths(
    prompt_lengths: Sequence[int] | np.ndarray, response_lengths: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    prompts = np.asarray(prompt_lengths, dtype=np.int64)
    responses = np.asarray(response_lengths, dtype=np.int64)
    if prompts.ndim != 1 or prompts.shape != responses.shape:
        raise UsageError(f"got {prompts.shape} prompt lengths for {responses.shape} response lengths")
    return prompts, responses


def micro_batches(
    prompt_lengths: Sequence[int] | np.ndarray,
    response_lengths: Sequence[int] | np.ndarray,
    max_tokens: int,
    *,
    key: str = "max_tokens",
) -> list[list[int]]:
    """Row indices grouped under ``max_tokens`` padded elements per group (see the module docstring);
    every row is in exactly one group, each group's indices ascending, groups longest first.

    Raises :class:`~agl_core.errors.UsageError` (a ``ValueError``) for mismatched lengths, a budget
    that is not a positive int, or a row longer than the budget on its own; ``key`` names the budget
    in the message.
    """
    prompts, responses = _lengths(prompt_lengths, response_lengths)
    check_budget(prompts, responses, max_tokens, key=key)
    totals = prompts + responses
    left = np.argsort(-totals, kind="stable")  # rows not grouped yet, longest first
    groups: list[list[int]] = []
    while len(left):
        members, prompt, response = [int(left[0])], int(prompts[left[0]]), int(responses[left[0]])
        left = left[1:]
        while len(left):
            wider_prompts, wider_responses = np.maximum(prompts[left], prompt), np.maximum(responses[left], response)
            sizes = (len(members) + 1) * (wider_prompts + wider_responses)
            # The group's padding once a row joins, less the padding it had: the same for every row.
            padding = np.where(sizes <= max_tokens, sizes - totals[left], np.iinfo(np.int64).max)
            best = int(np.argmin(padding))  # ties: the longest row
            if sizes[best] > max_tokens:
                break
            members.append(int(left[best]))
            prompt, response = int(wider_prompts[best]), int(wider_responses[best])
            left = np.delete(left, best)
        groups.append(sorted(members))
    return groups


def check_budget(
    prompt_lengths: Sequence[int] | np.ndarray,
    response_lengths: Sequence[int] | np.ndarray,
    max_tokens: int,
    *,
    key: str = "max_tokens",
) -> None:
    """Raise :class:`~agl_core.errors.UsageError` naming ``key`` unless ``max_tokens`` is a positive int
    that holds every row."""
    prompts, responses = _lengths(prompt_lengths, response_lengths)
    if not is_int(max_tokens, minimum=1):
        raise UsageError(f"{key} must be a positive integer, got {max_tokens!r}")
    totals = prompts + responses
    too_long = np.flatnonzero(totals > max_tokens)
    if len(too_long):
        i = int(too_long[0])
        raise UsageError(
            f"row {i} has {int(totals[i])} tokens (prompt + response), more than {key} = {max_tokens}; raise {key}"
        )


def padded_elements(
    prompt_lengths: Sequence[int] | np.ndarray,
    response_lengths: Sequence[int] | np.ndarray,
    groups: Sequence[Sequence[int]],
) -> int:
    """Tensor elements of ``groups`` once each is padded to its own longest prompt and response
    (compare with the rows' real tokens, ``sum(prompt_lengths) + sum(response_lengths)``)."""
    prompts, responses = _lengths(prompt_lengths, response_lengths)
    return sum(len(g) * (int(prompts[list(g)].max()) + int(responses[list(g)].max())) for g in groups if len(g))
