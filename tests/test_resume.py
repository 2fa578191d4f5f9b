"""An interrupted run continues from its last checkpoint with the same data order and state."""

from __future__ import annotations

import json

import pytest
import torch

from agl_core import hookimpl
from agl_core.checkpoint import latest_checkpoint
from agl_core.train import run
from tests.corridor_policy import build_corridor_policy

CONFIG = "examples/corridor/config.yaml"


class SeenInputs:
    """Records which dataset rows each step enqueued."""

    def __init__(self):
        self.by_step: dict[int, list[int]] = {}

    @hookimpl
    def agl_on_enqueue(self, request):
        self.by_step.setdefault(request.step, [])
        if request.input["id"] not in self.by_step[request.step]:
            self.by_step[request.step].append(request.input["id"])


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_corridor_policy(tmp_path_factory.mktemp("policy"))


def _overrides(policy, run_dir, steps):
    return [
        f"actor_rollout_ref.model.path={policy}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    ]


def test_restart_continues_from_step_k_with_the_same_data_order(policy, tmp_path):
    straight = SeenInputs()
    run(CONFIG, _overrides(policy, tmp_path / "straight", 4), plugins=[straight], show_progress=False)

    interrupted = SeenInputs()
    run(CONFIG, _overrides(policy, tmp_path / "resumed", 2), plugins=[interrupted], show_progress=False)
    assert latest_checkpoint(tmp_path / "resumed").name == "global_step_2"
    state_after_2 = torch.load(tmp_path / "resumed" / "global_step_2" / "trainer_state.pt", weights_only=False)
    resumed = SeenInputs()
    run(CONFIG, _overrides(policy, tmp_path / "resumed", 4), plugins=[resumed], show_progress=False)

    assert sorted(resumed.by_step) == [3, 4]  # nothing before step k was redone
    assert interrupted.by_step == {1: straight.by_step[1], 2: straight.by_step[2]}
    assert resumed.by_step == {3: straight.by_step[3], 4: straight.by_step[4]}
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert state_after_2["step"] == 2 and state_after_2["data"] == {"epoch": 0, "index": 2}
    assert state_after_2["optimizer"]["state"], "the optimizer's moments are saved"


def test_resume_mode_disable_starts_over(policy, tmp_path):
    run(CONFIG, _overrides(policy, tmp_path, 1), show_progress=False)
    again = SeenInputs()
    run(CONFIG, [*_overrides(policy, tmp_path, 1), "trainer.resume_mode=disable"], plugins=[again], show_progress=False)
    assert sorted(again.by_step) == [1]
