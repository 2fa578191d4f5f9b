"""Metric sinks (``trainer.logger``): chosen by name from the registry, fed by ``agl train`` on every
backend, and each built-in checked by reading back what it wrote (no network: W&B runs offline)."""

from __future__ import annotations

import json

import pytest

from agl_core import hookimpl
from agl_core.cli import main
from agl_core.config import REDACTED, ConfigError, load_config
from agl_core.data import CompletedRollout, Triplet
from agl_core.plugins import DISABLE_AUTOLOAD_ENV, PluginManager, RegistryError
from agl_core.runs.train import run
from agl_core.stages.pipeline import StepPipeline
from agl_core.stages.samples import TRAJECTORY_SAMPLE_SIZE, trajectory_sample
from tests.helpers.corridor_policy import build_corridor_policy
from tests.helpers.scripted_backend import (
    KEY,
    MISMATCH,
    OPENED,
    TRAJECTORY,
    Plugin,
    Scripted,
    scripted_run,
)
from tests.helpers.wandb_mode import use_wandb_mode


@pytest.fixture(autouse=True)
def own_plugins_only(monkeypatch):
    """Built-ins and agl's own entry points, whatever else the environment has installed."""
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_unknown_sink_names_trainer_logger_and_the_registered_sinks_before_the_backend_is_built(capsys):
    # No model is configured: the backend would fail on that, so the sink check came first.
    assert main(["train", "examples/corridor/config.yaml", "trainer.logger=[console,tensorbord]"]) == 2
    err = capsys.readouterr().err
    assert "unknown metric sink 'tensorbord' (set by trainer.logger); registered: " in err
    assert "did you mean 'tensorboard'" in err
    registered = err.split("registered: ")[1].split(";")[0].split(", ")
    assert {"console", "jsonl", "tensorboard", "wandb", "mlflow"} <= set(
        registered
    )  # mlflow: verl's, through agl_backend_verl
    with pytest.raises(RegistryError, match=r"registered: .*memory"):
        scripted_run("unused", ["nope"])


def test_a_plugin_sink_gets_every_step_samples_first_and_a_redacted_config(tmp_path):
    OPENED.clear()
    scripted_run(tmp_path, ["memory"])
    (sink,) = OPENED
    assert (sink.context.run_dir, sink.context.project_name, sink.context.experiment_name) == (
        tmp_path,
        "agl-tests",
        "scripted",
    )
    assert sink.context.config["agentlightning"]["agl_key"] == REDACTED
    kinds = [(call[0], call[1]) if len(call) > 1 else call for call in sink.calls]
    assert kinds == [("metrics", 0), ("samples", 1), ("metrics", 1), ("samples", 2), ("metrics", 2), ("close",)]
    assert sink.calls[1][2] == {"trajectories": [TRAJECTORY], "mismatches": [MISMATCH]}
    assert sink.calls[2][2]["training/reward"] == 0.25 and sink.calls[2][2]["wall_s"] >= 0


def test_the_run_log_is_always_written_and_resumes_without_duplicates(tmp_path):
    scripted_run(tmp_path, [])
    scripted_run(tmp_path, [], first_step=1)  # a run resumed from step 0's checkpoint redoes 1 and 2
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(m["step"], m["script/step"]) for m in metrics] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert metrics[1]["val/reward"] == 0.5 and metrics[3]["actor/pg_loss"] is None  # NaN is written as null
    trajectories = read_jsonl(tmp_path / "samples" / "trajectories.jsonl")
    assert trajectories == [
        {**TRAJECTORY, "step": 2},
        {**TRAJECTORY, "step": 3},
    ]  # the first run's rows of steps 1, 2 went
    assert read_jsonl(tmp_path / "samples" / "mismatches.jsonl") == [{**MISMATCH, "step": 2}]
    assert (tmp_path / "metrics.png").stat().st_size > 1000


def test_console_prints_a_line_per_step(tmp_path, capsys):
    scripted_run(tmp_path, ["console"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step:")]
    assert len(lines) == 3
    assert lines[1].startswith("step:1 - actor/pg_loss:0.1 - script/step:1 - training/reward:0.25 - wall_s:")


def test_tensorboard_event_files_hold_the_scalars_and_the_sample_tables(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scripted_run(tmp_path, ["tensorboard"])
    scripted_run(tmp_path, ["tensorboard"], first_step=2)  # resumed from step 1: redoes step 2
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"training/reward", "actor/pg_loss", "val/reward", "script/step"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("script/step")] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
    ]
    rewards = [(e.step, e.value) for e in events.Scalars("training/reward")]
    assert rewards == [(1, 0.25), (3, 0.25), (4, 0.75)], "the first run's step 2 was purged"
    texts = events.Tensors("samples/mismatches/text_summary")
    assert [text.step for text in texts] == [1, 3]
    table = texts[0].tensor_proto.string_val[0].decode()
    assert "| rollout_id |" in table and "template" in table and "[1, 2]" in table
    trajectories = events.Tensors("samples/trajectories/text_summary")
    assert "go \\| left" in trajectories[0].tensor_proto.string_val[0].decode()


def wandb_history(path, wait_s=60.0):
    """The W&B run file's bytes once its records are on disk: ``run.finish()`` may return before W&B's
    service has written them (they are, by the time the process exits)."""
    import time

    deadline = time.monotonic() + wait_s
    while path.stat().st_size < 100 and time.monotonic() < deadline:
        time.sleep(0.1)
    return path.read_bytes()


def test_wandb_offline_keeps_the_run_with_its_metrics_and_tables_in_the_run_directory(tmp_path, monkeypatch):
    use_wandb_mode(monkeypatch, "offline")
    scripted_run(tmp_path, ["wandb"])
    run_id = (tmp_path / "wandb" / "run_id").read_text().strip()
    (folder,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
    history = wandb_history(folder / f"run-{run_id}.wandb")
    assert b"training/reward" in history and b"agl-tests" in history and KEY.encode() not in history
    (table,) = (folder / "files" / "media" / "table" / "samples").glob("mismatches_*.table.json")
    content = json.loads(table.read_text())
    assert content["columns"] == list(MISMATCH) and content["data"] == [
        [1, "r0", "g0", 1, "template", "[1, 2]", "[1, 3]"]
    ]
    assert len(list((folder / "files" / "media" / "table" / "samples").glob("trajectories_*.table.json"))) == 2


def test_the_torch_backend_logs_its_steps_and_samples_through_the_sinks(tmp_path_factory, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    policy = build_corridor_policy(tmp_path_factory.mktemp("policy"))
    overrides = [
        f"actor_rollout_ref.model.path={policy}",
        f"trainer.default_local_dir={tmp_path}",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.logger=[tensorboard]",
    ]
    run("examples/corridor/config.yaml", overrides, show_progress=False)
    trajectories = read_jsonl(tmp_path / "samples" / "trajectories.jsonl")
    assert len(trajectories) == 4 and {t["step"] for t in trajectories} == {1}
    assert all(t["prompt"] and isinstance(t["response"], str) and t["n_calls"] >= 1 for t in trajectories)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("training/reward")] == [1]
    assert "samples/trajectories/text_summary" in events.Tags()["tensors"]


def test_the_pipeline_keeps_the_step_samples_until_the_backend_takes_them():
    def rollout(rid, index, calls):
        triplets = [Triplet(prompt_ids=p, response_ids=r, response_log_probs=[-0.5] * len(r)) for p, r in calls]
        return CompletedRollout(
            rollout_id=rid, group_id="g", state="succeeded", triplets=triplets, final_reward=1.0, sample_index=index
        )

    config = load_config(
        overrides=[
            "data.train_batch_size=1",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        ]
    )
    pipeline = StepPipeline(config, PluginManager(load_entrypoints=False))
    broken = rollout("broken", 0, [([1, 2], [3, 4]), ([9, 9], [5])])  # the second prompt does not extend the first call
    pipeline.prepare([rollout("merged", 0, [([1, 2], [3]), ([1, 2, 3, 7], [6])]), broken], step=3)
    samples = pipeline.take_samples()
    assert [(m["step"], m["rollout_id"], m["turn_index"]) for m in samples["mismatches"]] == [(3, "broken", 1)]
    trajectories = [(t["rollout_id"], t["prompt"], t["response"]) for t in samples["trajectories"]]
    assert trajectories == [("merged", "1 2 3 7", "6"), ("broken", "9 9", "5")]
    assert pipeline.take_samples() == {}


def test_the_trajectory_sample_is_the_first_24_rollouts_in_dataset_order():
    call = Triplet(prompt_ids=[1], response_ids=[2])
    rollouts = [
        CompletedRollout(
            rollout_id=f"r{i}",
            group_id="g",
            state="succeeded",
            step=i % 2,
            sample_index=29 - i,
            final_reward=0.0,
            triplets=[call],
        )
        for i in range(30)
    ]
    rollouts.append(CompletedRollout(rollout_id="no-calls", group_id="g", state="failed", final_reward=0.0))
    rows = trajectory_sample(rollouts, step=5)
    assert len(rows) == TRAJECTORY_SAMPLE_SIZE == 24
    expected = sorted((r for r in rollouts if r.triplets), key=lambda r: (r.step, r.sample_index))[:24]
    assert [row["rollout_id"] for row in rows] == [r.rollout_id for r in expected]
    assert rows[0] == {
        "step": 5,
        "rollout_id": "r28",
        "group_id": "g",
        "reward": 0.0,
        "n_calls": 1,
        "prompt": "1",
        "response": "2",
    }


def without_wandb_login(monkeypatch, tmp_path):
    """No W&B key anywhere W&B looks (environment, ~/.netrc, its settings) and online mode."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_SILENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / ".config" / "wandb"))
    use_wandb_mode(monkeypatch, "online")


def test_wandb_without_a_login_names_trainer_logger_the_sink_and_offline_mode(tmp_path, monkeypatch, capsys):
    without_wandb_login(monkeypatch, tmp_path)
    from agl_core.tracking import open_sinks
    from agl_core.tracking.wandb_sink import WandB

    config = load_config(overrides=[f"trainer.default_local_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as info:
        open_sinks([("wandb", WandB)], config)
    assert info.value.key == "trainer.logger"
    assert "metric sink 'wandb' could not start a W&B run" in info.value.message
    assert "WANDB_MODE=offline" in info.value.message and "\n" not in str(info.value)


def test_a_sink_that_cannot_start_is_a_trainer_logger_error_after_the_backends_own_checks(tmp_path):
    class Refuses:
        def __init__(self, context):
            raise RuntimeError("tracker server unreachable\nmore detail")

    class ChecksInFit(Scripted):
        """Refuses in fit, before its first step, as verl's GPU check does."""

        def fit(self, on_step=None):
            raise ConfigError("trainer.n_gpus_per_node", "no GPU")

    class Plugins(Plugin):
        @hookimpl
        def agl_register_metric_sinks(self, register):
            register("refuses", Refuses)

        @hookimpl
        def agl_register_backends(self, register):
            register("scripted", Scripted)
            register("checks_in_fit", ChecksInFit)

    overrides = [
        f"trainer.default_local_dir={tmp_path}",
        "trainer.total_training_steps=2",
        "trainer.logger=[console,refuses]",
    ]
    with pytest.raises(ConfigError, match="no GPU"):
        run(None, [*overrides, "agentlightning.backend=checks_in_fit"], plugins=[Plugins()], show_progress=False)
    with pytest.raises(ConfigError) as info:
        run(None, [*overrides, "agentlightning.backend=scripted"], plugins=[Plugins()], show_progress=False)
    assert info.value.key == "trainer.logger"
    assert info.value.message == "metric sink 'refuses' could not start: RuntimeError: tracker server unreachable"
