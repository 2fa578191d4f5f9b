"""The example backend (examples/ddp_backend: agl's step loop, the update in two gloo processes)
teaches the corridor policy to follow the signs, as the reference backend does
(tests/e2e/test_example_learns.py, whose numbers and thresholds it shares: its sampled rewards were
the reference's, step for step)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.paths import REPO_ROOT
from tests.helpers.torch_runs import LEARNED, LEARNING_STEPS, corridor_run

sys.path.insert(0, str(REPO_ROOT / "examples" / "ddp_backend"))  # as pip install -e examples/ddp_backend does
import agl_ddp_backend  # noqa: E402

pytestmark = pytest.mark.slow


def test_twenty_steps_on_two_processes_teach_the_policy_to_follow_the_signs(tmp_path, monkeypatch):
    # The backend given in code only, whether or not its package (and entry point) is installed.
    monkeypatch.setenv("AGL_DISABLE_PLUGIN_AUTOLOAD", "1")
    lines = corridor_run(tmp_path, LEARNING_STEPS, "agentlightning.backend=ddp", plugins=[agl_ddp_backend])
    rewards = [line["training/reward"] for line in lines if line["step"] > 0]
    assert len(rewards) == LEARNING_STEPS
    assert rewards[0] < 0.2, "a random policy should start near the 0.03 baseline"
    assert sum(rewards[-5:]) / 5 >= LEARNED, rewards
    assert lines[-1]["val/reward"] >= 0.9, "greedy answers should follow the signs (always one direction scores 0.5)"
