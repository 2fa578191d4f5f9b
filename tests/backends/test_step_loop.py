"""The step loop both backends run (agl_core.backends.loop), on a trainer that records what it is asked."""

from __future__ import annotations

import attrs
import pytest

from agl_core.backends.loop import LoopControl, LoopSettings, run_steps


class Recorder:
    """A StepTrainer whose batches are two numbered samples and whose calls land in ``log``."""

    def __init__(self, step=0):
        self.step = step
        self.log: list[tuple] = []
        self.n_batches = 0

    def next_batch(self):
        self.n_batches += 1
        return [self.n_batches * 10, self.n_batches * 10 + 1]

    def train_step(self, samples):
        self.step += 1
        self.log.append(("train", self.step, len(samples)))
        return {"training/reward": float(self.step)}

    def validate(self):
        self.log.append(("validate", self.step))
        return {"val/reward": 0.5}

    def save(self):
        self.log.append(("save", self.step))


def drive(trainer, settings, control=LoopControl):
    """Run the loop as a backend's fit does, recording each report among the trainer's calls."""
    for step, total, metrics in run_steps(trainer, settings, control):
        trainer.log.append(("report", step, total, "val/reward" in metrics))
        if "training/stopped_early" in metrics:
            trainer.log.append(("stopped early", step))
    return trainer.log


def test_a_fresh_run_validates_first_then_trains_validates_reports_and_saves_in_order():
    log = drive(Recorder(), LoopSettings(total_steps=3, test_freq=2, save_freq=2, validate_first=True))
    assert log == [
        ("validate", 0),
        ("report", 0, 3, True),
        ("train", 1, 2),
        ("report", 1, 3, False),
        ("train", 2, 2),
        ("validate", 2),
        ("report", 2, 3, True),
        ("save", 2),
        ("train", 3, 2),
        ("validate", 3),  # the last step is validated and saved whatever the frequencies say
        ("report", 3, 3, True),
        ("save", 3),
    ]


def test_step_and_validation_times_are_reported():
    reports = list(run_steps(Recorder(), LoopSettings(total_steps=1, test_freq=1, validate_first=True)))
    assert "timing/val_s" in reports[0][2] and "timing/step_s" not in reports[0][2]
    assert reports[1][2]["timing/step_s"] >= 0 and reports[1][2]["training/reward"] == 1.0


@pytest.mark.parametrize("start", [0, 2])
def test_the_first_step_of_a_run_fills_the_async_source_and_later_steps_hand_it_one_batch(start):
    log = drive(Recorder(step=start), LoopSettings(total_steps=start + 3, fill=5))
    assert [entry[2] for entry in log if entry[0] == "train"] == [6, 2, 2]


def test_a_resumed_run_does_not_validate_before_training():
    log = drive(Recorder(step=2), LoopSettings(total_steps=3, validate_first=True, save_freq=1))
    assert log == [("train", 3, 2), ("report", 3, 3, False), ("save", 3)]


@pytest.mark.parametrize("start", [0, 2])
def test_val_only_validates_once_and_stops(start):
    log = drive(Recorder(step=start), LoopSettings(total_steps=5, validate_first=True, val_only=True))
    assert log == [("validate", start), ("report", start, 5, True)]


def test_val_only_without_validation_first_trains():
    log = drive(Recorder(), LoopSettings(total_steps=1, val_only=True))
    assert log == [("train", 1, 2), ("report", 1, 1, False)]


def test_a_run_resumed_at_its_last_step_says_there_is_nothing_to_train(caplog):
    with caplog.at_level("WARNING", logger="agl_core.backends.loop"):
        assert drive(Recorder(step=3), LoopSettings(total_steps=3, validate_first=True)) == []
    assert "nothing to train: the run resumed at step 3 of 3; raise trainer.total_training_steps" in caplog.text


@pytest.mark.parametrize("has_validation", [True, False])
def test_what_the_trainer_asks_after_a_step_adds_a_checkpoint_a_validation_or_ends_the_run(has_validation):
    asked = {1: LoopControl(save=True), 2: LoopControl(validate=True), 3: LoopControl(stop=True)}
    trainer = Recorder()
    settings = LoopSettings(total_steps=5, test_freq=4 if has_validation else -1, save_freq=4)
    log = drive(
        trainer, attrs.evolve(settings, has_validation=has_validation), lambda: asked.get(trainer.step, LoopControl())
    )
    validated = has_validation
    assert log == [
        ("train", 1, 2),
        ("report", 1, 5, False),
        ("save", 1),  # asked, though save_freq is 4
        ("train", 2, 2),
        *[("validate", 2)] * validated,  # asked, though test_freq is 4; no validation rows: none
        ("report", 2, 5, validated),
        ("train", 3, 2),
        *[("validate", 3)] * validated,  # the run's last step, as a last step is
        ("report", 3, 5, validated),
        ("stopped early", 3),
        ("save", 3),
    ]


def test_a_validation_may_end_the_run():
    trainer = Recorder()
    validations = []

    def validate():
        validations.append(trainer.step)
        return {"val/reward": 0.0}

    trainer.validate = validate
    log = drive(trainer, LoopSettings(total_steps=5, test_freq=2), lambda: LoopControl(stop=bool(validations)))
    assert log == [
        ("train", 1, 2),
        ("report", 1, 5, False),
        ("train", 2, 2),
        ("report", 2, 5, True),
        ("stopped early", 2),
    ]


def test_the_log_gets_each_reports_metrics_first_and_may_end_the_run():
    """``log`` sees the metrics a report carries (validation included) before the loop reads
    ``control()``, as TRL's ``on_log`` does before the trainer reads ``TrainerControl``."""
    logged = []
    settings = LoopSettings(total_steps=5, test_freq=2, validate_first=True)
    stop_after_third_log = lambda: LoopControl(stop=len(logged) == 3)  # noqa: E731
    reports = list(run_steps(Recorder(), settings, stop_after_third_log, lambda m: logged.append(dict(m))))
    assert [step for step, _, _ in reports] == [0, 1, 2], "the run ended after the step whose log asked it"
    assert logged[:2] == [m for _, _, m in reports[:2]] and "val/reward" in logged[0]
    assert logged[2] == {k: v for k, v in reports[2][2].items() if k != "training/stopped_early"}
    assert "val/reward" in logged[2] and reports[2][2]["training/stopped_early"] == 1.0


def test_a_step_whose_report_stops_the_run_is_checkpointed_as_scheduled():
    """The consumer raising at a report (a run stopped for training nothing) closes the loop there:
    the step still gets its scheduled checkpoint, as verl's loop gives it one before reporting."""
    trainer = Recorder()
    steps = run_steps(trainer, LoopSettings(total_steps=5, save_freq=2))
    for step, _, _ in steps:
        if step == 2:
            steps.close()
            break
    assert trainer.log == [("train", 1, 2), ("train", 2, 2), ("save", 2)]
    trainer = Recorder()
    steps = run_steps(trainer, LoopSettings(total_steps=5, save_freq=2))
    next(steps)
    steps.close()  # step 1: not a checkpointed step
    assert trainer.log == [("train", 1, 2)]
