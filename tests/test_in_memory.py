"""``agl_core.runs.in_memory.run_ppo``: an Agent Lightning v1.0 script's ``run_ppo(config, train_dataset=...,
val_dataset=...)`` with the config and datasets held in memory, on the torch backend, logging every
step to the run log and the ``trainer.logger`` sinks with no ``on_step``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from agl_core import hookimpl
from agl_core.config import ConfigError
from agl_core.runs.in_memory import run_ppo
from tests.helpers.corridor_policy import build_corridor_policy
from tests.helpers.paths import REPO_ROOT

CORRIDOR = REPO_ROOT / "examples" / "corridor"


def script_config(policy, run_dir) -> dict:
    """What a script builds in code: the corridor example's config as a dict, edited in place."""
    config = OmegaConf.to_container(OmegaConf.load(CORRIDOR / "config.yaml"))
    config["actor_rollout_ref"]["model"]["path"] = str(policy)
    config["actor_rollout_ref"]["rollout"]["n"] = 2
    config["data"].update(train_batch_size=2, train_files=None, val_files=None)
    config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 2
    config["trainer"].update(
        total_training_steps=2, save_freq=-1, test_freq=2, default_local_dir=str(run_dir), logger=["capture"]
    )
    return config


class Capture:
    """A metric sink named ``capture``: what reaches the trainer.logger sinks."""

    def __init__(self):
        self.steps: list[tuple[int, dict]] = []

    @hookimpl
    def agl_register_metric_sinks(self, register):
        register("capture", lambda context: self)

    def log_metrics(self, step, metrics):
        self.steps.append((step, dict(metrics)))

    def log_samples(self, step, samples):
        pass

    def close(self):
        pass


def rows(name):
    return [json.loads(line) for line in (CORRIDOR / name).read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_a_v1_style_script_trains_on_the_torch_backend_and_logs_to_the_sinks(tmp_path):
    policy = build_corridor_policy(tmp_path / "policy")
    run_dir = tmp_path / "run"
    config = script_config(policy, run_dir)
    # pandas gives numpy arrays for list columns of a parquet file
    train = [{**row, "signs": np.array(row["signs"])} for row in rows("dataset.jsonl")[:8]]
    capture = Capture()
    out = run_ppo(OmegaConf.create(config), train, rows("val.jsonl")[:2], plugins=[capture], show_progress=False)

    assert out == run_dir
    assert [step for step, _ in capture.steps] == [0, 1, 2]  # validation before training, then two steps
    for _, metrics in capture.steps[1:]:
        assert metrics["training/n_rollouts"] == 4 and "actor/pg_loss" in metrics
    assert capture.steps[-1][1]["val/n_rollouts"] == 2
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [0, 1, 2]
    written = [json.loads(line) for line in (run_dir / "datasets" / "train.jsonl").read_text().splitlines()]
    assert written == rows("dataset.jsonl")[:8]


def test_a_bad_key_is_refused_by_name_before_anything_starts(tmp_path):
    config = script_config(tmp_path / "no-policy", tmp_path / "run")
    config["agentlightning"]["trace_aggregator"]["levl"] = "trajectory"
    with pytest.raises(ConfigError) as info:
        run_ppo(config, rows("dataset.jsonl"))
    assert info.value.key == "agentlightning.trace_aggregator.levl"
    assert "unknown key (in the config given to run_ppo); did you mean 'level'?" in info.value.message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ([{"signs": ["left"]}, "not a row"], "row 1 must be a mapping, got str"),
        ([{"signs": {1, 2}}], "row 0 cannot be written as JSON: a set is not a JSON value"),
        ([], "is empty"),
        ("train.jsonl", "must be a sequence of rows"),
    ],
)
def test_a_bad_dataset_is_refused_naming_the_argument_and_the_row(tmp_path, train, message):
    config = script_config(tmp_path / "no-policy", tmp_path / "run")
    with pytest.raises(ConfigError, match=message) as info:
        run_ppo(config, train)
    assert info.value.key == "train_dataset"


def test_the_callers_config_is_not_changed(tmp_path):
    config = OmegaConf.create(script_config(tmp_path / "no-policy", tmp_path / "run"))
    before = OmegaConf.to_container(config)
    with pytest.raises(ConfigError):
        run_ppo(config, [])
    assert OmegaConf.to_container(config) == before
