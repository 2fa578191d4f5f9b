"""What the trl tests share: the corridor's policy, its config with the trl backend, a TRL callback."""

from __future__ import annotations

import pytest
from transformers import TrainerCallback

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
