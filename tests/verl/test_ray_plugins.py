"""agl's losses and estimators inside real Ray worker processes, through both registration paths."""

from __future__ import annotations

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
from agl_core import hookimpl


def doubled_sum(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    return 2.0 * ((log_prob - old_log_prob) * advantages * response_mask).sum(), {}


@hookimpl
def agl_register_policy_losses(register):
    register("doubled_sum_test", doubled_sum)
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


def test_third_party_agl_loss_reaches_verl_workers(ray_session, third_party_site):
    env = {
        "env_vars": {
            "PYTHONPATH": os.pathsep.join([third_party_site, os.environ.get("PYTHONPATH", "")]),
            "AGL_DISABLE_PLUGIN_AUTOLOAD": "",
        }
    }
    result = ray.get(remote_verl_loss.options(runtime_env=env).remote("doubled_sum_test"))
    assert result["found"]
    assert result["plugin"] == "doubled"
    old, new, advantages, mask = loss_inputs()
    assert result["loss"] == pytest.approx(float(2.0 * ((new - old) * advantages * mask).sum()), rel=1e-6)


def test_runtime_env_keeps_other_external_modules():
    from agl_backend_verl.verl_plugins import MODULE, ray_runtime_env

    assert MODULE == "agl_backend_verl.verl_plugins"
    env = ray_runtime_env({"env_vars": {EXTERNAL_MODULES_ENV: "my_pkg.plugins", "X": "1"}, "working_dir": None})
    assert env["env_vars"] == {EXTERNAL_MODULES_ENV: "my_pkg.plugins,agl_backend_verl.verl_plugins", "X": "1"}
    assert env["working_dir"] is None
    assert ray_runtime_env(env) == env  # idempotent
