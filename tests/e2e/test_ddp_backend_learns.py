"""The example backend (examples/ddp_backend: agl's step loop, the update in two gloo processes)
teaches the corridor policy to follow the signs, as the reference backend does
(tests/e2e/test_example_learns.py, whose numbers and thresholds it shares: its sampled rewards were
the reference's, step for step); a loss whose parts do not add up over the processes' shares, and a
vision-language policy, are refused before any process starts."""

from __future__ import annotations

import sys

import pytest

from agl_core import ConfigError
from agl_core.config import load_config
from agl_core.plugins import PluginManager
from tests.helpers.paths import REPO_ROOT
from tests.helpers.torch_runs import LEARNED, LEARNING_STEPS, corridor_run
from tests.helpers.whole_batch_loss import WHOLE_BATCH_LOSS, WholeBatchLoss

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


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("agentlightning.plugins.ddp.processes=2", "agentlightning.plugins.ddp.processes"),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        ),
    ],
)
def test_a_loss_that_does_not_add_up_over_the_split_is_refused_by_the_key_that_splits(override, key):
    config = load_config(
        overrides=[
            WHOLE_BATCH_LOSS,
            "agentlightning.plugins.ddp.processes=1",
            override,
        ]
    )
    plugins = PluginManager.from_config(config, (agl_ddp_backend, WholeBatchLoss()), load_entrypoints=False)
    with pytest.raises(ConfigError, match=rf"{key}: the policy loss declares additive_over_micro_batches=False"):
        agl_ddp_backend.DdpBackend(config, plugins)


def test_a_vision_language_policy_is_refused_by_agl_check(vision_policy_dir):
    """The plain update passes no images to the model: a vision-language policy is refused by name."""
    config = load_config(overrides=[f"actor_rollout_ref.model.path={vision_policy_dir}"])
    with pytest.raises(ConfigError, match="is a vision-language model; backend 'ddp' trains text models only") as error:
        agl_ddp_backend.check_ddp_config(config)
    assert error.value.key == "actor_rollout_ref.model.path"
