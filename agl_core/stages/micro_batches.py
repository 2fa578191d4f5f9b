"""Token-budget micro-batches: rows grouped by length so that each group, padded only to its own
longest prompt and response, holds at most a budget of tensor elements.

verl's dynamic batch size (``actor_rollout_ref.actor.use_dynamic_bsz`` with
``ppo_max_token_len_per_gpu``, and the log-prob equivalents ``rollout.log_prob_*`` and
``ref.log_prob_*``) bounds the tokens of each forward pass instead of its number of rows. A backend
that pads (no sequence packing) pays for every padded element, so here the budget bounds the padded
size: a group of ``n`` rows whose longest prompt is ``P`` and longest response ``R`` (tensorised
with exactly those widths) costs ``n × (P + R)`` elements, never more than ``max_tokens``.

Rows are taken longest first (prompt + response, ties by input order) and each group is filled while
the next row still fits, so neighbours have similar lengths and padding stays small. A row that
alone exceeds the budget is refused (the config check asks for a budget of at least
``max_prompt_length + max_response_length``, so a validated run never meets one).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

__all__ = ["MicroBatch", "micro_batches", "padded_elements"]


@attrs.frozen
class MicroBatch:
    """Rows (indices into the input, ascending) and the widths they are padded to."""

    rows: tuple[int, ...]
    prompt_length: int
    response_length: int

    @property
    def padded_elements(self) -> int:
        return len(self.rows) * (self.prompt_length + self.response_length)


def micro_batches(
    prompt_lengths: Sequence[int] | np.ndarray, response_lengths: Sequence[int] | np.ndarray, max_tokens: int | None
) -> list[MicroBatch]:
    """Group rows under ``max_tokens`` padded elements per group (see the module docstring).

    ``max_tokens=None`` puts every row in one group (no micro-batching). Raises ``ValueError`` for
    mismatched lengths, a non-positive budget, or a row longer than the budget on its own.
    """
    prompts = np.asarray(prompt_lengths, dtype=np.int64)
    responses = np.asarray(response_lengths, dtype=np.int64)
    if prompts.shape != responses.shape or prompts.ndim != 1:
        raise ValueError(f"got {prompts.shape} prompt lengths for {responses.shape} response lengths")
    if not len(prompts):
        return []
    if max_tokens is None:
        return [MicroBatch(tuple(range(len(prompts))), int(prompts.max()), int(responses.max()))]
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    totals = prompts + responses
    too_long = np.flatnonzero(totals > max_tokens)
    if len(too_long):
        i = int(too_long[0])
        raise ValueError(f"row {i} has {int(totals[i])} tokens, more than the micro-batch budget of {max_tokens}")
    groups: list[MicroBatch] = []
    members: list[int] = []
    longest_prompt = longest_response = 0
    for i in np.argsort(-totals, kind="stable").tolist():
        p, r = int(prompts[i]), int(responses[i])
        wider_prompt, wider_response = max(longest_prompt, p), max(longest_response, r)
        if members and (len(members) + 1) * (wider_prompt + wider_response) > max_tokens:
            groups.append(MicroBatch(tuple(sorted(members)), longest_prompt, longest_response))
            members, wider_prompt, wider_response = [], p, r
        members.append(i)
        longest_prompt, longest_response = wider_prompt, wider_response
    groups.append(MicroBatch(tuple(sorted(members)), longest_prompt, longest_response))
    return groups


def padded_elements(groups: Sequence[MicroBatch]) -> int:
    """Tensor elements of ``groups`` once padded (compare with the rows' real tokens)."""
    return sum(group.padded_elements for group in groups)
