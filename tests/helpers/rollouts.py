"""Hand-built rollouts and model calls, the inputs of the aggregator and pipeline tests."""

from __future__ import annotations

from agl_core.data import CompletedRollout, Triplet
from agl_core.stages.aggregation import AggregationSettings

LIMITS = AggregationSettings(max_prompt_length=100, max_response_length=100)


def call(prompt, response, log_probs="auto", reward=None):
    """One model call; ``"auto"`` log-probs are -0.5, -1.5, ... per response token."""
    if log_probs == "auto":
        log_probs = [-0.5 - i for i in range(len(response))]
    return Triplet(prompt_ids=prompt, response_ids=response, response_log_probs=log_probs, reward=reward)


def rollout(*calls, reward=1.0, rollout_id="r", group_id="g"):
    """A succeeded rollout of ``calls``."""
    return CompletedRollout(
        rollout_id=rollout_id, group_id=group_id, state="succeeded", triplets=calls, final_reward=reward
    )


def two_group_batch():
    """Two groups of two rollouts; r0 breaks its trajectory (two rows), the others merge into one."""
    return [
        rollout(
            call([1, 2], [3, 4], log_probs=[-0.5] * 2),
            call([9, 9], [5], log_probs=[-0.5]),
            reward=1.0,
            rollout_id="r0",
            group_id="g0",
        ),
        rollout(
            call([1, 2], [3], log_probs=[-0.5]),
            call([1, 2, 3, 7], [6, 6], log_probs=[-0.5] * 2),
            reward=0.0,
            rollout_id="r1",
            group_id="g0",
        ),
        rollout(call([1], [2, 2, 2], log_probs=[-0.5] * 3), reward=1.0, rollout_id="r2", group_id="g1"),
        rollout(call([1], [2], log_probs=[-0.5]), reward=0.5, rollout_id="r3", group_id="g1"),
    ]
