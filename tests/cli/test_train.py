"""``agl train``: clear one-line errors for bad input; a short run writes metrics and the plot."""

from __future__ import annotations

import json

import pytest

from agl_core.cli import main
from tests.helpers.corridor_policy import build_corridor_policy

CONFIG = "examples/corridor/config.yaml"


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_corridor_policy(tmp_path_factory.mktemp("policy"))


def _small(policy, run_dir, steps=2):
    return [
        f"actor_rollout_ref.model.path={policy}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={steps}",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    ]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "actor_rollout_ref.model.path=/nonexistent/model",
            "actor_rollout_ref.model.path: model folder /nonexistent/model does not exist",
        ),
        (
            "agentlightning.trace_aggregator.level=nope",
            "unknown aggregator 'nope' (set by agentlightning.trace_aggregator.level); registered: ",
        ),
        ("algorithm.adv_estimator=nope", "unknown advantage estimator 'nope'"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=nope", "unknown policy loss 'nope'"),
        ("backend=nope", "unknown backend 'nope' (set by agentlightning.backend); registered: "),
    ],
)
def test_bad_names_and_paths_fail_with_one_clear_line(policy, tmp_path, capsys, override, message):
    overrides = [o for o in _small(policy, tmp_path) if not o.startswith(override.split("=")[0] + "=")]
    assert main(["train", CONFIG, *overrides, override]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    if "registered" in message and "backend" in message:
        assert "torch" in err


def test_invalid_jsonl_dataset_names_file_and_line(policy, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"signs": ["left"]}\n{not json\n')
    assert main(["train", CONFIG, *_small(policy, tmp_path), f"data.train_files={data}"]) == 2
    err = capsys.readouterr().err
    assert "data.train_files" in err and f"{data} line 2 is not valid JSON" in err


def test_a_short_run_writes_metrics_plot_and_checkpoint(policy, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", CONFIG, *_small(policy, run_dir), "trainer.save_freq=2"]) == 0
    assert f"agl: run finished; metrics, plot and checkpoints in {run_dir}" in capsys.readouterr().out
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    # the example validates before training (step 0) and after the last step, one rollout per val row
    assert lines[0]["val/n_rollouts"] == lines[2]["val/n_rollouts"] == 32 and "val/reward" not in lines[1]
    for line in lines[1:]:
        assert line["training/n_rollouts"] == 4
        assert 0.0 <= line["training/reward"] <= 1.0
        assert line["training/n_sample"] >= line["training/n_rollouts"]
        assert "actor/pg_loss" in line and "timing/step_s" in line and line["wall_s"] > 0
    assert (run_dir / "metrics.png").stat().st_size > 1000
    assert (run_dir / "global_step_2" / "model" / "model.safetensors").is_file()
    (run_dir / "metrics.png").unlink()
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "metrics.png").is_file()


@pytest.mark.parametrize(
    ("checkpoints", "said"), [(False, "metrics and plot"), (True, "metrics, plot and checkpoints")]
)
def test_train_says_what_the_run_wrote(tmp_path, capsys, monkeypatch, checkpoints, said):
    """With trainer.save_freq=0 (or the default -1) no checkpoint is written, and agl train does
    not say there is one."""
    import agl_core.runs.train

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "metrics.png").write_bytes(b"png")
    if checkpoints:
        (tmp_path / "global_step_1").mkdir()
    monkeypatch.setattr(agl_core.runs.train, "run", lambda config, overrides, show_progress: tmp_path)
    assert main(["train", CONFIG, "trainer.save_freq=0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"agl: run finished; {said} in {tmp_path}"


def test_under_a_launcher_only_rank_0_reports(tmp_path, capsys, monkeypatch):
    """torchrun's processes other than rank 0 follow it: no progress bar, nothing said at the end."""
    import agl_core.runs.train

    shown = []
    monkeypatch.setattr(
        agl_core.runs.train, "run", lambda config, overrides, show_progress: shown.append(show_progress) or tmp_path
    )
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        assert main(["train", CONFIG]) == 0
    assert shown == [False, True]
    assert capsys.readouterr().out.splitlines() == [f"agl: run finished; nothing in {tmp_path}"]


def test_the_run_log_replaces_lines_of_steps_a_restart_redoes(tmp_path):
    """A run killed after logging step 3 but before checkpointing it resumes at step 2 and redoes 3:
    the log keeps one line per step, the redone one."""
    import json

    from agl_core.runs.train import MetricsLog

    first = MetricsLog(tmp_path, show_progress=False)
    for step in (0, 1, 2, 3):
        first(step, 4, {"training/reward": float(step)})
    restarted = MetricsLog(tmp_path, show_progress=False)
    restarted(3, 4, {"training/reward": 30.0})
    restarted(4, 4, {"training/reward": 40.0})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["training/reward"]) for line in lines] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
        (4, 40.0),
    ]


FAILING = "agentlightning.local.agent_class=tests.helpers.agents:FailingAgent"


@pytest.mark.parametrize(("limit", "stopped_at"), [(2, 2), (0, 3)])
def test_a_run_whose_every_rollout_fails_exits_non_zero_naming_why(policy, tmp_path, capsys, limit, stopped_at):
    """max_untrained_steps in a row stop the run; with the stop off, a run that ends having trained
    nothing fails. Each step that trained nothing is logged as it happens, with its cause."""
    run_dir = tmp_path / "run"
    overrides = [*_small(policy, run_dir, steps=3), FAILING, "trainer.val_before_train=false", "trainer.test_freq=-1"]
    overrides += ["trainer.save_freq=2"]
    assert main(["train", CONFIG, *overrides, f"agentlightning.max_untrained_steps={limit}"]) == 2
    err = capsys.readouterr().err
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, stopped_at + 1))  # the stopping step is on record
    # checkpointed as the schedule says, the stopping step too (verl's loop checkpoints before reporting)
    assert (
        sorted(p.name for p in run_dir.glob("global_step_*")) == [f"global_step_{n}" for n in (2, 3)][: stopped_at - 1]
    )
    assert "every rollout failed (4 of 4)" in err and "run finished" not in err
    if limit:
        assert "agl: error: steps 1 to 2 trained nothing (2 in a row, agentlightning.max_untrained_steps=2)" in err
    else:
        assert "agl: error: the run trained nothing: no step of it trained a row" in err


def test_a_step_that_trains_nothing_between_trained_steps_is_a_warning_only(caplog):
    from agl_core.backends.untrained import UntrainedSteps

    watch = UntrainedSteps(limit=2)
    for step, trained in enumerate([1, 0, 1, 0, 1], start=1):
        watch.observe(step, {"training/n_skipped_updates": float(not trained), "training/n_sample_trained": trained})
    watch.check_end()
    assert [r.getMessage() for r in caplog.records if "trained nothing" in r.getMessage()] == [
        "step 2 trained nothing: no rollout came back",
        "step 4 trained nothing: no rollout came back",
    ]


@pytest.mark.parametrize(
    ("metrics", "reason"),
    [
        ({"training/n_sample_trained": 8.0}, None),
        ({"val/reward": 1.0}, None),  # a validation report says nothing of training
        (
            {"training/n_skipped_updates": 1.0, "training/rollouts/n_failed": 6.0, "training/n_rollouts": 0.0},
            "every rollout failed (6 of 6)",
        ),
        (
            {"training/n_skipped_updates": 1.0, "training/n_rollouts": 4.0, "training/n_rollouts_w_trace": 0.0},
            "none of the 4 rollouts made a model call with tokens",
        ),
        (
            {
                "training/n_skipped_updates": 1.0,
                "training/n_rollouts": 4.0,
                "training/n_rollouts_w_trace": 4.0,
                "training/n_sample": 0.0,
                "training/n_skipped_empty_rows": 4.0,
            },
            "the 4 rollouts gave no training row (skipped without a trained token: 4",
        ),
        (
            {
                "training/n_sample_trained": 0.0,
                "training/n_rollouts": 4.0,
                "training/n_rollouts_w_trace": 4.0,
                "training/n_sample": 4.0,
                "training/n_sample_dropped/same_reward": 4.0,
            },
            "every one of the 4 rows was dropped before the update (marked 0, same_reward 4, random 0)",
        ),
    ],
)
def test_the_reason_a_step_trained_nothing_comes_from_its_metrics(metrics, reason):
    from agl_core.backends.untrained import untrained_reason

    said = untrained_reason(metrics)
    assert said == reason if reason is None else said.startswith(reason)
