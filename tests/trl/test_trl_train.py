"""``agl train`` with ``backend=trl`` on the corridor example: a short run exits, serves a new weight
version after every step, and a stopped run resumed from its checkpoint continues at the next step
with the optimizer and lr schedule the checkpoint holds; a TRL callback (``trl.callbacks``) sees every
step, and what it asks in ``TrainerControl`` steers the loop."""

from __future__ import annotations

import json

import pytest
import torch

from agl_backend_trl.backend import TrlBackend
from agl_core import hookimpl
from agl_core.backends.checkpoints import read_state
from agl_core.plugins import PluginManager
from agl_core.runs.train import run
from tests.trl.conftest import CONFIG, Logged, Steering, StepsSeen, corridor_overrides

SMALL = (
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "trainer.save_freq=1",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trl.callbacks=[tests.trl.conftest:StepsSeen,tests.trl.conftest:Logged]",
)


class Versions:
    """The weight versions served, in order."""

    def __init__(self):
        self.seen: list[int] = []

    @hookimpl
    def agl_on_weights_served(self, version: int) -> None:
        self.seen.append(version)


def train(policy, run_dir, steps, *extra):
    versions = Versions()
    overrides = corridor_overrides(policy, run_dir, *SMALL, f"trainer.total_training_steps={steps}", *extra)
    run(CONFIG, overrides, [versions], show_progress=False)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return versions.seen, [line["step"] for line in lines if "actor/grad_norm" in line]


def test_a_stopped_run_resumes_from_its_checkpoint(corridor_policy, tmp_path):
    run_dir = tmp_path / "run"
    versions, steps = train(corridor_policy, run_dir, 2)
    assert versions == [0, 1, 2] and steps == [1, 2]
    assert StepsSeen.seen == [1, 2], "the TRL callback saw each step end"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reported = [{k: v for k, v in line.items() if k not in ("step", "wall_s")} for line in lines]  # the log's own
    assert Logged.logs == reported, "on_log gets every metric of the step, as metrics.jsonl does"
    assert (run_dir / "global_step_2" / "model" / "model.safetensors").is_file()

    versions, steps = train(corridor_policy, run_dir, 3)
    assert versions == [2, 3], "the resumed run serves the checkpoint's weights, then step 3's"
    assert steps == [1, 2, 3], "the resumed run appends step 3 to the run's metrics"

    from agl_backend_trl.config import load_trl_config

    config = load_trl_config(
        CONFIG, corridor_overrides(corridor_policy, run_dir, *SMALL, "trainer.total_training_steps=3")
    )
    backend = TrlBackend(config, PluginManager.from_config(config, (), load_entrypoints=False))
    assert backend.resume() and backend.step == 3
    saved = read_state(run_dir / "global_step_3")
    loaded = backend.trainer.optimizer.state_dict()
    assert loaded["state"].keys() == saved["optimizer"]["state"].keys()
    for index, state in saved["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(loaded["state"][index][name], value), (index, name)
    assert backend.trainer.lr_scheduler.state_dict() == saved["scheduler"]


def test_a_callback_that_fails_is_named_with_the_event(corridor_policy, tmp_path):
    """transformers' ``EarlyStoppingCallback`` asserts in ``on_train_begin`` that the trainer keeps its
    best model, which agl's loop does not: the run fails naming the callback, not as agl's own error."""
    from agl_core import UsageError

    early = "trl.callbacks=[{transformers:EarlyStoppingCallback: {early_stopping_patience: 2}}]"
    failed = r"trainer_callback:EarlyStoppingCallback \(trl\.callbacks\) failed in on_train_begin: AssertionError"
    with pytest.raises(UsageError, match=failed):
        train(corridor_policy, tmp_path / "run", 1, early)


def test_a_callback_asks_for_a_checkpoint_a_validation_and_the_end_and_its_state_is_checkpointed(
    corridor_policy, tmp_path
):
    run_dir = tmp_path / "run"
    steer = (
        "trainer.save_freq=-1",
        "trl.callbacks=[tests.trl.conftest:Steering]",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",  # a bf16 run, end to end
        "trl.use_cpu=true",
    )
    versions, steps = train(corridor_policy, run_dir, 4, *steer)
    assert steps == [1, 2] and versions == [0, 1, 2], "stopped after step 2 of 4"
    assert Steering.events == [("save", 1), ("evaluate", 2)]
    assert sorted(path.name for path in run_dir.glob("global_step_*")) == ["global_step_1"]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [("val/reward" in line, line.get("training/stopped_early")) for line in lines] == [
        (False, None),
        (True, 1.0),
    ]
    assert read_state(run_dir / "global_step_1")["callbacks"] == {"Steering": Steering(steps_ended=1).state()}

    from agl_backend_trl.config import load_trl_config

    config = load_trl_config(CONFIG, corridor_overrides(corridor_policy, run_dir, *SMALL, *steer))
    backend = TrlBackend(config, PluginManager.from_config(config, (), load_entrypoints=False))
    (steering,) = [cb for cb in backend.trainer.callback_handler.callbacks if isinstance(cb, Steering)]
    assert steering.steps_ended == 0 and backend.resume() and steering.steps_ended == 1
