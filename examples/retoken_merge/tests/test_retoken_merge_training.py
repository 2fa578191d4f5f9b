"""retoken_merge selected by name in a real (tiny) training run: it aggregates every step's rollouts."""

import agl_retoken_merge
from agl_retoken_merge import REALIGNED_METRIC


def test_it_aggregates_a_real_training_run(agl_training):
    run = agl_training(
        plugins=[agl_retoken_merge], overrides={"agentlightning.trace_aggregator.level": "retoken_merge"}, steps=2
    )
    for step in (1, 2):
        line = run.step(step)
        assert line[REALIGNED_METRIC] >= 0 and line["training/n_rollouts"] == 4
        # One row per rollout, plus one per break it could not re-align, less the rows with nothing to train.
        rows = (
            line["training/n_rollouts_w_trace"]
            + line["training/n_trace_merge_mismatch_rows"]
            - line["training/n_skipped_empty_rows"]
        )
        assert line["training/n_sample"] == rows
