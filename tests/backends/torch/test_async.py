"""The reference backend in async mode, without servers: what it feeds the source, and what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_core.backends.loop import next_samples
from agl_core.backends.torch.backend import TorchBackend
from agl_core.config import ConfigError, load_config
from agl_core.plugins import PluginManager
from tests.helpers.paths import REPO_ROOT

CONFIG = str(REPO_ROOT / "examples" / "corridor" / "config.yaml")


def backend(policy: Path, tmp_path: Path, *extra: str) -> TorchBackend:
    config = load_config(
        CONFIG,
        [
            f"actor_rollout_ref.model.path={policy}",
            f"trainer.default_local_dir={tmp_path}",
            f"data.train_files={REPO_ROOT / 'examples' / 'corridor' / 'dataset.jsonl'}",
            "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "data.shuffle=false",
            "agentlightning.async_rollout.enabled=true",
            "agentlightning.async_rollout.async_train_batch_size=5",
            *extra,
        ],
    )
    return TorchBackend(config, PluginManager(load_entrypoints=False))


def test_the_first_async_step_fills_the_in_flight_groups_and_later_steps_top_up(policy: Path, tmp_path: Path):
    trainer = backend(policy, tmp_path, "agentlightning.agl_base_url=http://127.0.0.1:1")
    rows = trainer.data.rows
    assert trainer.loop.fill == 5
    first = next_samples(trainer, trainer.loop.fill)
    # Whole batches until at least async_train_batch_size groups: the source keeps the extra one.
    assert first == rows[:6]
    assert next_samples(trainer) == rows[6:8]
    assert trainer.data.position() == {"epoch": 0, "index": 4}  # a checkpoint records what was handed out


def test_async_rollout_without_the_gateway_names_the_key(policy: Path, tmp_path: Path):
    with pytest.raises(ConfigError, match=r"agentlightning\.async_rollout\.enabled.*agl_base_url"):
        backend(policy, tmp_path)
