"""Recording each step's rollouts (``agentlightning.record_rollouts``), replaying them
(``agentlightning.replay``, ``agl replay``), and refusing what does not fit."""

from __future__ import annotations

import json
import sys

import pytest

from agl_core.cli import main
from agl_core.config import ConfigError, load_config
from agl_core.data import CompletedRollout, Triplet
from agl_core.files.recording import (
    FORMAT,
    FORMAT_VERSION,
    RECORDING_FILE,
    RecordingError,
    RecordingWriter,
    read_recording,
)
from agl_core.plugins import PluginManager
from agl_core.stages.pipeline import StepPipeline
from agl_core.testing.harness import run_training, tiny_policy
from agl_core.testing.recorded import gateway_trace_rollouts, recorded_steps, run_pipeline
from tests.helpers.gateway_fixtures import Plan, SimulatedController, always, gateway_config, good_call, plugin_manager
from tests.helpers.paths import GATEWAY_TRACES, RECORDED_CORRIDOR, REPO_ROOT

# What differs between a run and its replay by nature: wall times, and the counts only a live source has.
LIVE_ONLY = (
    "timing/",
    "training/events/n_calls",
    "training/events/n_reward_events",
    "training/hooks/",
    "training/n_hook",
    "training/rollouts/",
)
LIVE_ONLY_NAMES = {"training/n_rollouts_w_reward", "wall_s"}


def shared_metrics(metrics: dict) -> dict:
    """The metrics a replayed step must reproduce: everything but what only a live run measures."""
    return {
        k: v
        for k, v in metrics.items()
        if not k.startswith(LIVE_ONLY)
        and k not in LIVE_ONLY_NAMES
        and not k.startswith(("training/record/", "training/replay/"))
    }


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two recorded steps of the tiny task (embedded source, torch backend), checkpointed after each."""
    folder = tmp_path_factory.mktemp("recorded")
    return run_training(
        overrides={"agentlightning.record_rollouts": True, "trainer.save_freq": 1}, steps=2, run_dir=folder
    )


def test_each_step_is_appended_as_the_pipeline_received_it(recorded):
    path = recorded.run_dir / RECORDING_FILE
    lines = path.read_bytes().splitlines(keepends=True)
    header = json.loads(lines[0])
    assert (header["format"], header["version"]) == (FORMAT, FORMAT_VERSION)
    assert header["tokenizer"]["vocab_size"] > 0 and len(header["tokenizer"]["sha256"]) == 64
    assert header["model"]["model_type"] == "llama"
    assert header["config"]["agentlightning"]["record_rollouts"] is True
    assert [json.loads(line)["step"] for line in lines[1:]] == [1, 2]
    for line, metrics in zip(lines[1:], recorded.metrics[1:]):
        assert metrics["training/record/bytes"] == len(line)
    recording = read_recording(recorded.run_dir)
    replayed = [r for step in (1, 2) for r in recording.rollouts(step)]
    assert [r.to_dict() for r in replayed] == [r.to_dict() for r in recorded.train_rollouts]
    assert all(r.triplets and r.queued_at and r.ended_at for r in replayed)


def test_a_replayed_run_reproduces_every_step(recorded, tmp_path):
    replay = run_training(
        overrides={"agentlightning.replay": str(recorded.run_dir), "data.val_files": None}, steps=2, run_dir=tmp_path
    )
    assert [m["step"] for m in replay.metrics] == [1, 2]
    assert replay.rollouts == [], "no agent ran"
    for original, again in zip(recorded.metrics[1:], replay.metrics):
        assert again["training/replay/n_rollouts_replayed"] == original["training/n_rollouts"]
        assert shared_metrics(again) == shared_metrics(original)
        assert "actor/grad_norm" in again


def test_agl_replay_reruns_one_step_from_the_checkpoint_before_it(recorded, capsys):
    assert main(["replay", str(recorded.run_dir), "--step", "2"]) == 0
    printed = dict(line.split(": ") for line in capsys.readouterr().out.splitlines())
    original = recorded.step(2)
    for name in ("actor/pg_loss", "actor/entropy_loss", "actor/grad_norm", "training/n_sample", "training/reward"):
        assert float(printed[name]) == pytest.approx(original[name], rel=1e-5, abs=1e-7), name


def test_agl_replay_names_a_step_the_recording_lacks(recorded, capsys):
    assert main(["replay", str(recorded.run_dir), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert f"{recorded.run_dir / RECORDING_FILE} has no step 7 (it holds steps 1..2)" in err


def test_a_recording_of_another_tokenizer_is_refused_naming_file_step_and_mismatch(recorded, tmp_path):
    lines = (recorded.run_dir / RECORDING_FILE).read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["tokenizer"]["sha256"] = "0" * 64
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(header) + "\n" + "".join(lines[1:]))
    with pytest.raises(
        RecordingError,
        match=rf"{other} step 1: recorded with another model or tokenizer: tokenizer sha256 is '0+' in the recording",
    ):
        run_training(
            overrides={"agentlightning.replay": str(other), "data.val_files": None}, steps=1, run_dir=tmp_path / "run"
        )
    header["tokenizer"]["sha256"] = json.loads(lines[0])["tokenizer"]["sha256"]
    header["model"]["hidden_size"] = 4096
    other.write_text(json.dumps(header) + "\n" + "".join(lines[1:]))
    with pytest.raises(RecordingError, match=r"step 1: .*model hidden_size is 4096 in the recording, 32 in this run"):
        main(["--traceback", "replay", str(other), "--step", "1"])


def test_a_replayed_run_cannot_validate(recorded, tmp_path):
    with pytest.raises(ConfigError, match="agentlightning.replay.*holds training steps only"):
        run_training(overrides={"agentlightning.replay": str(recorded.run_dir)}, steps=1, run_dir=tmp_path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["agentlightning.record_rollouts=maybe"], "agentlightning.record_rollouts"),
        (
            ["agentlightning.replay=/nonexistent/run"],
            "agentlightning.replay: /nonexistent/run is neither a rollout recording",
        ),
        (
            ["agentlightning.replay={run}", "agentlightning.agl_base_url=http://127.0.0.1:1"],
            "agentlightning.replay: a replayed run runs no agents",
        ),
        (
            ["agentlightning.replay={run}", "agentlightning.record_rollouts=true", "trainer.default_local_dir={run}"],
            "agentlightning.replay: .* is this run's own recording",
        ),
    ],
)
def test_the_keys_are_validated_naming_them(recorded, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[o.format(run=recorded.run_dir) for o in overrides])


def _rollout(secret: str) -> CompletedRollout:
    return CompletedRollout(
        rollout_id="r1",
        group_id="g1",
        state="succeeded",
        triplets=[
            Triplet(
                prompt_ids=[1, 2], response_ids=[3], response_log_probs=[-0.5], metadata={"note": f"Bearer {secret}"}
            )
        ],
        final_reward=1.0,
        input={"question": "q", "token": secret},
        config={"k8s": {"job_template": f"env: AGL_KEY={secret}"}},
        error=f"401 with key {secret}",
    )


def test_the_gateway_key_is_never_written(tmp_path):
    secret = "sk-gateway-0123456789"
    config = load_config(
        overrides=[
            f"actor_rollout_ref.model.path={tiny_policy()}",
            f"trainer.default_local_dir={tmp_path}",
            "agentlightning.record_rollouts=true",
            "agentlightning.agl_base_url=http://127.0.0.1:1",
            f"agentlightning.agl_key={secret}",
        ]
    )
    from transformers import AutoTokenizer

    writer = RecordingWriter(config, AutoTokenizer.from_pretrained(tiny_policy()))
    metrics = writer.write(1, [_rollout(secret)])
    text = (tmp_path / RECORDING_FILE).read_text()
    assert secret not in text
    assert metrics["training/record/n_redacted_strings"] == 4
    assert json.loads(text.splitlines()[0])["config"]["agentlightning"]["agl_key"] == "***"
    assert read_recording(tmp_path).rollouts(1)[0].input["token"] == "***"


def test_a_resumed_run_appends_and_the_last_copy_of_a_redone_step_wins(tmp_path):
    from transformers import AutoTokenizer

    config = load_config(
        overrides=[
            f"actor_rollout_ref.model.path={tiny_policy()}",
            f"trainer.default_local_dir={tmp_path}",
            "agentlightning.record_rollouts=true",
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_policy())
    RecordingWriter(config, tokenizer).write(1, [_rollout("x")])
    RecordingWriter(config, tokenizer).write(1, [CompletedRollout(rollout_id="again", group_id="g", state="failed")])
    recording = read_recording(tmp_path)
    assert len((tmp_path / RECORDING_FILE).read_text().splitlines()) == 3, "one header, two step lines"
    assert [r.rollout_id for r in recording.rollouts(1)] == ["again"]


@pytest.mark.parametrize("async_rollout", [False, True], ids=["sync", "async"])
def test_the_gateway_sources_rollouts_are_recorded_without_the_key(gateway, tiny_model_dir, tmp_path, async_rollout):  # noqa: F811
    """Recording sits in the pipeline, after any source: the gateway's rollouts are recorded as the
    pipeline gets them, and the gateway's key is not, even where a sample carries it."""
    from transformers import AutoTokenizer

    from agl_core.rollouts.gateway import gateway_source

    extra = (
        ["agentlightning.async_rollout.enabled=true", "agentlightning.async_rollout.async_train_batch_size=4"]
        if async_rollout
        else []
    )
    config = gateway_config(
        gateway, f"trainer.default_local_dir={tmp_path}", "agentlightning.record_rollouts=true", *extra
    )
    config.actor_rollout_ref.model.path = str(tiny_model_dir)
    source = gateway_source(config, plugin_manager())
    pipeline = StepPipeline(
        config, PluginManager(load_entrypoints=False), AutoTokenizer.from_pretrained(tiny_model_dir)
    )
    plan = Plan(events=(good_call(), ("reward", {"value": 1.0})))
    try:
        with SimulatedController(gateway, always(plan)):
            samples = [{"q": i, "auth": gateway.key} for i in range(4 if async_rollout else 2)]
            batch = source.collect(samples, step=1, is_train=True)
            metrics = pipeline.prepare(batch.rollouts, step=1).metrics
    finally:
        source.close()
    text = (tmp_path / RECORDING_FILE).read_text()
    assert gateway.key not in text
    assert metrics["training/record/n_redacted_strings"] == 4
    assert metrics["training/record/bytes"] == len(text.splitlines(keepends=True)[1].encode())
    recorded = read_recording(tmp_path).rollouts(1)
    assert [r.rollout_id for r in recorded] == [r.rollout_id for r in batch.rollouts]
    assert [r.triplets[0].to_dict() for r in recorded] == [r.triplets[0].to_dict() for r in batch.rollouts]
    assert len(recorded) == 4 and all(r.final_reward == 1.0 and len(r.triplets) == 1 for r in recorded)


def test_a_file_that_is_not_a_recording_is_named(tmp_path):
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"step": 1}\n')
    with pytest.raises(RecordingError, match=f"{bad} line 1 is not a agl-rollouts header"):
        read_recording(bad)
    bad.write_text(json.dumps({"format": FORMAT, "version": 99}) + "\n")
    with pytest.raises(RecordingError, match="format version 99; this agl reads version 1"):
        read_recording(bad)
    bad.write_text(
        json.dumps({"format": FORMAT, "version": 1})
        + '\n{"step": 1, "rollouts": [{"rollout_id": "", "group_id": "g", "state": "succeeded"}]}\n'
    )
    with pytest.raises(RecordingError, match=rf"{bad} line 2 \(step 1\): .*rollout_id"):
        read_recording(bad)


# -- the kit: a plugin on recorded steps ------------------------------------------------------------

# The corridor example's settings that shape a step (examples/corridor/config.yaml).
CORRIDOR_SETTINGS = (
    "agentlightning.trace_aggregator.trajectory_max_prompt_length=256",
    "agentlightning.trace_aggregator.trajectory_max_response_length=256",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "algorithm.adv_estimator=turn_grpo",
    "algorithm.gamma=0.0",
)
PIPELINE_METRICS = (
    "training/n_sample",
    "training/n_sample_trained",
    "training/n_zero_adv_groups",
    "training/reward",
    "training/n_turns",
)


def test_the_corridor_fixture_replays_the_recorded_runs_pipeline():
    """Each shipped step, through the pipeline with the recorded config, gives the metrics the
    recording run logged (its metrics.jsonl, shipped beside it)."""
    logged = {
        m["step"]: m
        for m in (json.loads(line) for line in (RECORDED_CORRIDOR / "metrics.jsonl").read_text().splitlines())
    }
    steps = recorded_steps(RECORDED_CORRIDOR)
    assert sorted(steps) == [1, 2, 3] and all(len(rollouts) == 32 for rollouts in steps.values())
    for step, rollouts in steps.items():
        metrics = run_pipeline(rollouts, config=RECORDED_CORRIDOR, step=step).metrics
        assert {k: metrics[k] for k in PIPELINE_METRICS} == {k: logged[step][k] for k in PIPELINE_METRICS}


def test_a_third_party_plugin_set_runs_on_recorded_steps():
    sys.path.insert(0, str(REPO_ROOT / "examples" / "retoken_merge"))
    import agl_retoken_merge

    from tests.helpers.median_baseline import MedianBaseline

    overrides = {"agentlightning.trace_aggregator.level": "retoken_merge", "algorithm.adv_estimator": "median_baseline"}
    prepared = run_pipeline(
        recorded_steps(RECORDED_CORRIDOR)[2],
        [agl_retoken_merge, MedianBaseline()],
        overrides,
        config=RECORDED_CORRIDOR,
        step=2,
    )
    assert prepared.shaped is not None and prepared.metrics["training/n_sample_trained"] == 32
    assert "training/n_realigned_merges" in prepared.metrics


def test_the_real_gateway_traces_run_through_a_plugin(gateway_traces, tiny_model_dir):
    """retoken_merge decodes ids, so it gets the tokenizer that produced the traces."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO_ROOT / "examples" / "retoken_merge"))
    import agl_retoken_merge

    rollouts = gateway_trace_rollouts(GATEWAY_TRACES / "traces.json")
    assert [r.rollout_id for r in rollouts] == list(gateway_traces)
    assert next(r for r in rollouts if r.rollout_id == "failed_rollout").state == "failed"
    assert next(r for r in rollouts if r.rollout_id == "several_rewards_last_wins").final_reward == pytest.approx(0.9)
    small = {"data.train_batch_size": 1, "actor_rollout_ref.actor.ppo_mini_batch_size": 1}
    train = [r for r in rollouts if r.is_train and r.state == "succeeded"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trajectory = run_pipeline(train, overrides=small, tokenizer=tokenizer)
    level = {**small, "agentlightning.trace_aggregator.level": "retoken_merge"}
    merged = run_pipeline(train, [agl_retoken_merge], level, tokenizer=tokenizer)
    assert merged.metrics["training/n_realigned_merges"] > 0
    assert merged.metrics["training/n_sample"] < trajectory.metrics["training/n_sample"], (
        "retokenized turns merge into fewer rows"
    )


@pytest.mark.verl
@pytest.mark.ray
def test_the_verl_trainer_replays_the_recorded_corridor_steps(tmp_path):
    """The trainer the verl backend runs (verl's V1 trainer, its worker groups answered in this
    process, TransferQueue on a local Ray) with the replay source: each recorded step reaches its
    update with the pipeline metrics the recording run logged on the torch backend."""
    pytest.importorskip("verl")

    from agl_backend_verl.config import load_verl_config
    from agl_backend_verl.run import rollout_source, v1_config
    from agl_core import write_dataset
    from tests.helpers.corridor_policy import build_corridor_policy
    from tests.helpers.verl_local_workers import fit_locally, local_trainer_class, transfer_queue_session

    policy = build_corridor_policy(tmp_path / "policy")
    rows = write_dataset([{"signs": "x"}] * 12, tmp_path / "rows.jsonl", "train_dataset")
    config = load_verl_config(
        None,
        [
            *CORRIDOR_SETTINGS,
            f"agentlightning.replay={RECORDED_CORRIDOR}",
            f"actor_rollout_ref.model.path={policy}",
            f"data.train_files={rows}",
            f"data.val_files={rows}",
            "data.train_batch_size=4",
            "data.dataloader_num_workers=0",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "trainer.total_training_steps=3",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.device=cpu",
            "trainer.balance_batch=false",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    config = v1_config(config)
    plugins = PluginManager(load_entrypoints=False)
    with transfer_queue_session(config):
        trainer = local_trainer_class("sync", ["127.0.0.1:1"])(config, plugins=plugins)
        trainer.init()
        reports = fit_locally(trainer, rollout_source(config, plugins, trainer), n=8)
    seen = {step: metrics for step, _, metrics, _ in reports}
    logged = {
        m["step"]: m
        for m in (json.loads(line) for line in (RECORDED_CORRIDOR / "metrics.jsonl").read_text().splitlines())
    }
    assert sorted(seen) == [1, 2, 3]
    for step, metrics in seen.items():
        assert metrics["training/replay/n_rollouts_replayed"] == 32
        assert {k: metrics[k] for k in PIPELINE_METRICS} == {k: logged[step][k] for k in PIPELINE_METRICS}
    updated = trainer.local.actor.given["update_actor"]
    assert [sum(len(rank.keys) for rank in call) for call in updated] == [
        seen[step]["training/n_sample_trained"] for step in (1, 2, 3)
    ]


def test_agl_replay_reruns_a_shipped_corridor_step_from_the_initial_model(tmp_path, capsys):
    """The fixture ships no checkpoint, so step 2 runs from the initial policy: the recorded run's
    step 1 had no advantage (every reward 0) and left the weights as they were, so step 2's loss
    terms and gradient norm are the ones the run logged."""
    from tests.helpers.corridor_policy import build_corridor_policy

    policy = build_corridor_policy(tmp_path / "policy")
    assert main(["replay", str(RECORDED_CORRIDOR), "--step", "2", f"actor_rollout_ref.model.path={policy}"]) == 0
    printed = {k: float(v) for k, v in (line.split(": ") for line in capsys.readouterr().out.splitlines())}
    logged = next(
        json.loads(line)
        for line in (RECORDED_CORRIDOR / "metrics.jsonl").read_text().splitlines()
        if '"step": 2' in line
    )
    for name in (*PIPELINE_METRICS, "actor/pg_loss", "actor/entropy_loss", "actor/grad_norm"):
        assert printed[name] == pytest.approx(logged[name], rel=1e-5, abs=1e-7), name
