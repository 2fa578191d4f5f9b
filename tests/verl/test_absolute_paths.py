"""The paths a verl run's Ray processes open are absolute before they leave ``agl train``: on a
cluster started elsewhere the task runner and verl's workers run in another working directory."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

pytestmark = pytest.mark.verl
pytest.importorskip("ray")

from agl_backend_verl.shipping import absolute_paths  # noqa: E402


def test_relative_paths_are_made_absolute_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "policy").mkdir()
    config = OmegaConf.create(
        {
            "data": {"train_files": "data/train.jsonl", "val_files": ["a.parquet", "/abs/b.parquet"]},
            "agentlightning": {"replay": "runs/old"},
            "trainer": {"default_local_dir": "checkpoints"},
            "actor_rollout_ref": {"model": {"path": "policy"}},
        }
    )
    resolved = absolute_paths(config)
    assert resolved.data.train_files == str(tmp_path / "data" / "train.jsonl")
    assert list(resolved.data.val_files) == [str(tmp_path / "a.parquet"), "/abs/b.parquet"]
    assert resolved.agentlightning.replay == str(tmp_path / "runs" / "old")
    assert resolved.trainer.default_local_dir == str(tmp_path / "checkpoints")
    assert resolved.actor_rollout_ref.model.path == str(tmp_path / "policy")
    assert config.data.train_files == "data/train.jsonl"  # the caller's config is left as it was


def test_a_hub_model_id_unset_keys_and_urls_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = OmegaConf.create(
        {
            "data": {"train_files": "hdfs://cluster/train.parquet", "val_files": None},
            "agentlightning": {"replay": None},
            "actor_rollout_ref": {"model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}},
        }
    )
    assert absolute_paths(config) == config
