"""The corridor example learns: a CI-sized run of its own config reads the signs it is shown.

A freshly built random policy replies with a direction word about once in 17 turns, the right one
once in 34, so its reward (the fraction of right turns) starts near 0.03, and a policy that ignores
the signs and always gives one direction scores 0.5. Sampling is seeded per call, so a run
repeats. With the example's config, seeds 0-3 all had greedy validation at 1.0 by step 20 (passing a
sampled training reward of 0.9 at steps 27-34); this run's sampled reward climbs from 0.0 to 0.55
over its 20 steps (0.46 over the last 5). The thresholds sit between that and what a policy blind to
the signs reaches (greedy 0.5; sampled, the random policy's 0.03).
"""

from __future__ import annotations

from tests.helpers.torch_runs import LEARNED, LEARNING_STEPS, corridor_run


def test_twenty_steps_teach_the_policy_to_follow_the_signs(tmp_path):
    lines = corridor_run(tmp_path, LEARNING_STEPS)
    rewards = [line["training/reward"] for line in lines if line["step"] > 0]
    assert len(rewards) == LEARNING_STEPS
    assert rewards[0] < 0.2, "a random policy should start near the 0.03 baseline"
    assert lines[-1]["val/reward"] >= 0.9, "greedy answers should follow the signs (always one direction scores 0.5)"
    assert sum(rewards[-5:]) / 5 >= LEARNED, rewards
    # trajectory aggregation merges each rollout into one row; a reply that is a special token vanishes
    # from the re-rendered history, and only that rollout's rows split (counted)
    last = lines[-1]
    assert last["training/n_sample"] - last["training/n_trace_merge_mismatch_rows"] == last["training/n_rollouts"]
    assert last["training/n_trace_merge_mismatch_rows"] <= 3
