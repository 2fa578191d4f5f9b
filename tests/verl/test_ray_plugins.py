"""agl's losses and estimators inside real Ray worker processes, through both registration paths."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.slow]

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

# Workers import this module to run ``verl_loss``: it must not import agl_backend_verl at the top,
# or importing it would register the plugins and hide which path did.
EXTERNAL_MODULES_ENV = "VERL_USE_EXTERNAL_MODULES"

THIRD_PARTY = """
import dataclasses

from agl_core import hookimpl


@dataclasses.dataclass
class ScaledSumSettings:
    factor: float = 2.0


@hookimpl
def agl_plugin_settings():
    return {"scaled_sum_test": ScaledSumSettings}


@hookimpl
def agl_register_policy_losses(register, settings):
    factor = settings["scaled_sum_test"].factor

    def scaled_sum(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
        return factor * ((log_prob - old_log_prob) * advantages * response_mask).sum(), {}

    register("doubled_sum_test", scaled_sum)
"""


@pytest.fixture(scope="module")
def ray_session():
    """A plain local Ray session, started the way any user would (no agl runtime env)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def third_party_site(tmp_path_factory):
    """A directory laid out as ``pip install --target`` leaves it: a module plus its dist-info with an
    ``agl`` entry point."""
    site = tmp_path_factory.mktemp("site")
    (site / "agl_doubled_loss.py").write_text(THIRD_PARTY)
    info = site / "agl_doubled_loss-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: agl-doubled-loss\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("[agl]\ndoubled = agl_doubled_loss\n"))
    return str(site)


def loss_inputs():
    import torch

    generator = torch.Generator().manual_seed(7)
    old = -torch.rand(3, 5, generator=generator)
    new = old + 0.3 * torch.randn(3, 5, generator=generator)
    advantages = torch.randn(3, 5, generator=generator)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    return old, new, advantages, mask


ACTOR = {
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.28,
    "clip_ratio_c": 3.0,
    "global_batch_info": {"dp_size": 2},
}


def verl_loss(name: str):
    """Look ``name`` up the way verl's actor does, and run it on fixed inputs (in whatever process)."""
    import verl  # noqa: F401  (loads the verl.plugins entry points, as every verl worker does)
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn

    if name not in POLICY_LOSS_REGISTRY:
        return {"found": False, "pid": os.getpid()}
    fn = get_policy_loss_fn(name)
    old, new, advantages, mask = loss_inputs()
    loss, metrics = fn(old, new, advantages, mask, loss_agg_mode="token-mean", config=OmegaConf.create(ACTOR))
    return {
        "found": True,
        "plugin": getattr(fn, "_agl_plugin", None),
        "loss": float(loss),
        "metrics": metrics,
        "pid": os.getpid(),
        "modules_env": os.environ.get(EXTERNAL_MODULES_ENV, ""),
    }


remote_verl_loss = ray.remote(num_cpus=1)(verl_loss)


def driver_value():
    from agl_core.builtins.losses import per_rollout_mean
    from agl_core.stages.policy_loss import LossSettings

    old, new, advantages, mask = loss_inputs()
    settings = LossSettings(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, dp_size=2)
    loss, metrics = per_rollout_mean(old, new, advantages, mask, settings)
    return float(loss), metrics


def test_worker_finds_agls_loss_through_the_verl_plugins_entry_point(ray_session):
    result = ray.get(remote_verl_loss.remote("per_rollout_mean"))
    assert result["pid"] != os.getpid()
    assert result["found"], "the verl.plugins entry point did not register per_rollout_mean in the worker"
    assert result["plugin"] == "losses"
    assert result["modules_env"] == ""  # no runtime env: the entry point alone did it
    loss, metrics = driver_value()
    assert result["loss"] == pytest.approx(loss, rel=1e-6, abs=1e-7)
    assert result["metrics"] == pytest.approx(metrics)
    assert loss != 0.0


def test_external_modules_env_registers_it_when_entry_points_are_off(ray_session):
    from agl_backend_verl.verl_plugins import ray_runtime_env

    only_modules = ray_runtime_env({"env_vars": {"VERL_USE_EXTERNAL_PLUGINS": "none"}})
    result = ray.get(remote_verl_loss.options(runtime_env=only_modules).remote("per_rollout_mean"))
    assert result["found"]
    assert "agl_backend_verl.verl_plugins" in result["modules_env"].split(",")
    assert result["loss"] == pytest.approx(driver_value()[0], rel=1e-6, abs=1e-7)
    # the negative control: with both paths off the worker does not know the loss
    neither = {"env_vars": {"VERL_USE_EXTERNAL_PLUGINS": "none"}}
    assert not ray.get(remote_verl_loss.options(runtime_env=neither).remote("per_rollout_mean"))["found"]


def third_party_env(site, **env_vars):
    return {
        "env_vars": {
            "PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")]),
            "AGL_DISABLE_PLUGIN_AUTOLOAD": "",
            **env_vars,
        }
    }


def scaled_sum(factor):
    old, new, advantages, mask = loss_inputs()
    return float(factor * ((new - old) * advantages * mask).sum())


def test_third_party_agl_loss_reaches_verl_workers(ray_session, third_party_site):
    result = ray.get(remote_verl_loss.options(runtime_env=third_party_env(third_party_site)).remote("doubled_sum_test"))
    assert result["found"]
    assert result["plugin"] == "doubled"
    assert result["loss"] == pytest.approx(scaled_sum(2.0), rel=1e-6)  # the setting's default


def test_a_loss_in_a_verl_worker_is_built_with_the_runs_plugin_settings(ray_session, third_party_site):
    """What agl puts in the runtime env when it starts Ray: the worker builds the loss with the
    configured setting; a section only the driver's plugins declare is left out there, not refused."""
    from agl_backend_verl.config import load_verl_config
    from agl_backend_verl.run import ray_init_kwargs
    from agl_backend_verl.verl_plugins import PLUGIN_SETTINGS_ENV

    config = load_verl_config(
        None,
        [
            "actor_rollout_ref.model.path=/m",
            "agentlightning.agl_base_url=http://127.0.0.1:1",
            "agentlightning.plugins.scaled_sum_test.factor=3.0",
            "agentlightning.plugins.only_in_the_driver.x=1",
        ],
    )
    sent = ray_init_kwargs(config)["runtime_env"]["env_vars"][PLUGIN_SETTINGS_ENV]
    assert json.loads(sent) == {"only_in_the_driver": {"x": 1}, "scaled_sum_test": {"factor": 3.0}}
    env = third_party_env(third_party_site, **{PLUGIN_SETTINGS_ENV: sent})
    result = ray.get(remote_verl_loss.options(runtime_env=env).remote("doubled_sum_test"))
    assert result["found"] and result["loss"] == pytest.approx(scaled_sum(3.0), rel=1e-6)
    plain = load_verl_config(
        None, ["actor_rollout_ref.model.path=/m", "agentlightning.agl_base_url=http://127.0.0.1:1"]
    )
    assert PLUGIN_SETTINGS_ENV not in ray_init_kwargs(plain)["runtime_env"]["env_vars"]


def test_runtime_env_keeps_other_external_modules():
    from agl_backend_verl.verl_plugins import MODULE, ray_runtime_env

    assert MODULE == "agl_backend_verl.verl_plugins"
    env = ray_runtime_env({"env_vars": {EXTERNAL_MODULES_ENV: "my_pkg.plugins", "X": "1"}, "working_dir": None})
    assert env["env_vars"] == {EXTERNAL_MODULES_ENV: "my_pkg.plugins,agl_backend_verl.verl_plugins", "X": "1"}
    assert env["working_dir"] is None
    assert ray_runtime_env(env) == env  # idempotent
