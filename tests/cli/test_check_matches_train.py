"""``agl check`` refuses every run ``agl train`` would refuse before training, with the same error."""

from __future__ import annotations

import pytest

from agl_core.cli import main

CONFIG = "examples/corridor/config.yaml"

# Overrides agl train refuses before it trains (one per place a refusal comes from).
TRAIN_REFUSES = [
    ("trainer.logger=[csvv]", "unknown metric sink 'csvv' (set by trainer.logger)"),
    ("algorithm.adv_estimator=grpp", "unknown advantage estimator 'grpp' (set by algorithm.adv_estimator)"),
    ("agentlightning.trace_aggregator.level=trajectry", "unknown aggregator 'trajectry'"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=token_man", "unknown policy loss 'token_man'"),
    (
        "agentlightning.plugins.nobody.key=1",
        "config key agentlightning.plugins.nobody: no plugin declares these settings",
    ),
    ("data.train_files=/nonexistent/train.jsonl", "config key data.train_files: dataset file not found"),
    ("agentlightning.hook_timeout_seconds=often", "config key agentlightning.hook_timeout_seconds"),
]


@pytest.fixture(autouse=True)
def only_agls_own_plugins(monkeypatch):
    monkeypatch.setenv("AGL_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.mark.parametrize(("override", "message"), TRAIN_REFUSES, ids=[o for o, _ in TRAIN_REFUSES])
def test_check_refuses_what_train_refuses(override, message, capsys, tmp_path):
    run_dir = f"trainer.default_local_dir={tmp_path / 'run'}"
    outcomes = []
    for command in ("train", "check"):
        assert main([command, CONFIG, override, run_dir]) == 2, f"agl {command} accepted {override}"
        outcomes.append(capsys.readouterr().err.splitlines()[0])
    train, check = outcomes
    assert message in train and check == train
    assert not (tmp_path / "run").exists(), "nothing was trained"


def test_train_says_which_hook_turns_the_env_map_check_off(caplog):
    from agl_core import hookimpl
    from agl_core.runs.preflight import preflight
    from agl_core.runs.run_config import resolve_config

    plugin = type("Rewriter", (), {"agl_on_enqueue": hookimpl(lambda self, request: None)})()
    config, manager = resolve_config(CONFIG, [], [plugin])
    assert config.agentlightning.local.env_map, "the example config names env_map fields"
    with caplog.at_level("WARNING", logger="agl_core.runs.preflight"):
        preflight(config, manager)
    (name,) = manager.implementations("agl_on_enqueue")
    expected = f"agentlightning.local.env_map is not checked against the dataset rows: agl_on_enqueue of {name}"
    assert expected in caplog.text
