"""The integration harness trains real steps with the plugins given and shows what they did; the
built-ins train through it."""

from __future__ import annotations

import attrs
import pytest

from agl_core import hookimpl
from agl_core.testing.harness import run_training


class LateJudge:
    """Scores every rollout 1.0 after the fact, tags requests, and notes which rollouts it saw."""

    @hookimpl
    def agl_on_enqueue(self, request):
        return attrs.evolve(request, metadata={**request.metadata, "judge": "late"})

    @hookimpl
    def agl_on_succeeded(self, rollout, writer):
        writer.add_event(rollout.rollout_id, rollout.attempt_id or "0", "reward", {"value": 1.0})


def test_lifecycle_hooks_act_on_training_and_also_see_validation_rollouts(agl_training):
    run = agl_training(plugins=[LateJudge()], steps=2)
    assert [line["step"] for line in run.metrics] == [0, 1, 2]
    assert run.step(0)["val/n_rollouts"] == 2 and run.step(0)["val/reward"] == 1.0
    for step in (1, 2):
        line = run.step(step)
        assert line["training/n_rollouts"] == 4 and line["training/n_rollouts_w_trace"] == 4
        assert line["training/reward"] == 1.0, "the judge's late reward is what training reads"
        assert line["training/hooks/n_events_written"] == 4 and line["training/n_hook_failures"] == 0
    # The lifecycle hooks ran for validation rollouts too: is_train tells them apart.
    assert len(run.val_rollouts) == 2 and len(run.train_rollouts) == 8
    assert all(r.triplets for r in run.rollouts)
    assert [e.rollout_id for e in run.events] == [r.rollout_id for r in run.rollouts]
    assert {r.metadata["judge"] for r in run.requests} == {"late"} and len(run.requests) == 10
    assert not any(r.is_train for r in run.requests[:2])


def test_the_built_ins_train_through_the_harness(tmp_path):
    run = run_training(
        overrides={
            "agentlightning.trace_aggregator.level": "transition",
            "algorithm.adv_estimator": "turn_grpo",
            "actor_rollout_ref.actor.policy_loss.loss_mode": "token_mean",
            "trainer.val_before_train": False,
        },
        steps=1,
        run_dir=tmp_path,
    )
    (line,) = run.metrics
    assert line["training/n_turns"] == 8 and line["training/n_sample"] == 8, "transition: one row per call"
    assert line["training/n_skipped_updates"] in (0.0, 1.0) and "training/rollout_level_advantage/n_rows" in line
    assert run.val_rollouts == [] and (tmp_path / "run" / "metrics.jsonl").is_file()


def test_a_misspelt_override_fails_naming_the_key(tmp_path):
    from agl_core.config import ConfigError

    with pytest.raises(ConfigError, match="algorithm.adv_estimatr"):
        run_training(overrides=["algorithm.adv_estimatr=grpo"], run_dir=tmp_path)
