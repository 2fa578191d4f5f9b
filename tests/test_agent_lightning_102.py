"""Agent Lightning 1.0.2's trainer keys under agl, on both backends: each loads where agl honours it
and is refused by name, with the reason, where it does not.

In the Agent Lightning lanes (``scripts/al_lane.sh``, which sets ``AGL_EXPECT_AGENTLIGHTNING``)
``agentlightning==1.0.2`` is installed beside agl, and its own verl config (the ``config.yaml`` its
wheel ships) is loaded with every new key set over it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from agl_core.config import ConfigError
from agl_core.plugins import PluginManager
from agl_core.runs.train import resolve_config
from agl_core.stages.aggregation import settings_from_config

# The keys Agent Lightning 1.0.2's trainer reads that 1.0.0's did not, with values that use them,
# and verl V1's staleness bound that agl reads on both backends.
HONOURED = {
    "agentlightning.trace_aggregator.trajectory_max_total_length": 4096,
    "actor_rollout_ref.actor.policy_loss.loss_mode": "cispo_per_rollout_mean",
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,  # CISPO's clip keys, as 1.0.2 names them
    "actor_rollout_ref.actor.clip_ratio_high": 0.28,
    "trainer.v1.sampler.max_off_policy_threshold": 2,
    "trainer.v1.sampler.max_off_policy_strategy": "wait",
}
REFUSED = {
    "actor_rollout_ref.actor.megatron.router_replay.mode": ("R3", "MoE router replay (R3:"),
    "actor_rollout_ref.ref.megatron.router_replay.mode": ("R3", "MoE router replay (R3:"),
}
BACKENDS = ["torch", pytest.param("verl", marks=pytest.mark.verl)]


def shipped_verl_config() -> Path | None:
    """Agent Lightning's own verl config, where ``agentlightning`` is installed (found, not imported:
    ``agentlightning.verl`` imports verl 0.8's trainer)."""
    spec = importlib.util.find_spec("agentlightning")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "verl" / "config.yaml"
    return path if path.is_file() else None


def test_the_agent_lightning_lane_has_agentlightning_1_0_2():
    expected = os.environ.get("AGL_EXPECT_AGENTLIGHTNING")
    if expected is None:
        pytest.skip("not an Agent Lightning lane (scripts/al_lane.sh sets AGL_EXPECT_AGENTLIGHTNING)")
    assert importlib.metadata.version("agentlightning") == expected
    assert shipped_verl_config() is not None, "agentlightning's wheel ships verl/config.yaml"


def config_file(tmp_path: Path, backend: str, keys: dict) -> Path:
    """A run config with ``keys`` set: over Agent Lightning's shipped verl config when it is installed
    and the backend reads verl's configs, else over an empty file."""
    shipped = shipped_verl_config() if backend == "verl" else None
    base = OmegaConf.load(shipped) if shipped is not None else OmegaConf.create({})
    for key, value in keys.items():
        OmegaConf.update(base, key, value, force_add=True)
    OmegaConf.update(base, "agentlightning.agl_base_url", "http://127.0.0.1:1", force_add=True)
    path = tmp_path / "config.yaml"
    OmegaConf.save(base, path)
    return path


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_honoured_key_loads_and_is_used(tmp_path, backend):
    path = config_file(tmp_path, backend, HONOURED)
    config, manager = resolve_config(str(path), [f"agentlightning.backend={backend}"])
    for key, value in HONOURED.items():
        assert OmegaConf.select(config, key) == value, key
    assert settings_from_config(config).max_total_length == 4096
    assert "cispo_per_rollout_mean" in manager.policy_losses.names()
    if backend == "verl":  # the loss is in verl's registry too, where verl's workers look it up
        from agl_backend_verl.verl_plugins import ensure_registered

        ensure_registered("cispo_per_rollout_mean")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", sorted(REFUSED))
def test_every_unhonoured_key_is_refused_by_name_with_the_reason(tmp_path, backend, key):
    value, reason = REFUSED[key]
    path = config_file(tmp_path, backend, {**HONOURED, key: value})
    with pytest.raises(ConfigError) as info:
        resolve_config(str(path), [f"agentlightning.backend={backend}"])
    assert info.value.key == key
    assert reason in info.value.message and "remove the key" in info.value.message
    with pytest.raises(ConfigError) as info:  # as an override too
        resolve_config(None, [f"agentlightning.backend={backend}", f"{key}={value}"])
    assert info.value.key == key and "(in overrides)" in info.value.message


@pytest.mark.verl
def test_verls_rollout_routing_replay_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="MoE router replay") as info:
        resolve_config(
            None,
            ["agentlightning.backend=verl", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"],
        )
    assert info.value.key == "actor_rollout_ref.rollout.enable_rollout_routing_replay"


def test_the_built_in_losses_include_1_0_2s():
    assert "cispo_per_rollout_mean" in PluginManager(load_entrypoints=False).policy_losses.names()
