"""What the trl tests share: the corridor's policy, its config with the trl backend, a TRL callback."""

from __future__ import annotations

import pytest
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from tests.helpers.corridor_policy import shared_corridor_policy

CONFIG = "examples/corridor/config.yaml"


@pytest.fixture(scope="session")
def corridor_policy():
    """The corridor's tiny policy (seed 0, the recording's), built once per session."""
    return shared_corridor_policy()


def corridor_overrides(policy, run_dir, *extra):
    """The corridor example's config on ``policy``, writing under ``run_dir``, with the trl backend."""
    return [
        "agentlightning.backend=trl",
        f"actor_rollout_ref.model.path={policy}",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]


class StepsSeen(TrainerCallback):
    """A TRL callback (``trl.callbacks``) noting ``state.global_step`` at every ``on_step_end``."""

    seen: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        StepsSeen.seen.append(state.global_step)


class Logged(TrainerCallback):
    """A TRL callback noting the logs ``on_log`` gets."""

    logs: list[dict] = []

    def on_log(self, args, state, control, logs, **kwargs):
        Logged.logs.append(dict(logs))


class Steering(TrainerCallback, ExportableState):
    """A TRL callback that asks agl's loop, in ``TrainerControl``, for a checkpoint after step 1, a
    validation after step 2 and, once that validation is seen, the end of the run; it counts the
    steps it saw end (its exported state) and notes the ``on_save`` / ``on_evaluate`` events."""

    events: list[tuple[str, int]] = []

    def __init__(self, steps_ended: int = 0):
        self.steps_ended = steps_ended

    def on_step_end(self, args, state, control, **kwargs):
        self.steps_ended += 1
        control.should_save = state.global_step == 1
        control.should_evaluate = state.global_step == 2

    def on_save(self, args, state, control, **kwargs):
        Steering.events.append(("save", state.global_step))

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        assert "val/reward" in metrics
        Steering.events.append(("evaluate", state.global_step))
        control.should_training_stop = True

    def state(self) -> dict:
        return {"args": {}, "attributes": {"steps_ended": self.steps_ended}}
