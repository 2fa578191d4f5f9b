"""``agl train … backend=verl``: the run is validated against verl's full config (the backend's own
``load_config``), verl's step metrics reach ``on_step`` across Ray, and on CPU the command stops with
a clear error instead of a traceback from inside a Ray actor."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.verl

pytest.importorskip("verl")

from agl_core.cli import main  # noqa: E402
from agl_core.config import ConfigError  # noqa: E402
from agl_core.plugins import DISABLE_AUTOLOAD_ENV  # noqa: E402
from agl_core.runs.run_config import resolve_config  # noqa: E402
from tests.helpers.verl_configs import write_config  # noqa: E402


@pytest.fixture
def no_autoload(monkeypatch):
    """Only the built-ins and agl's own entry points (the verl backend among them), however the
    environment is installed."""
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    return []


def test_verl_only_keys_are_accepted_under_backend_verl(tmp_path, no_autoload):
    config, manager = resolve_config(str(write_config(tmp_path)), [], no_autoload)
    assert config.actor_rollout_ref.actor.fsdp_config.param_offload is True
    assert config.actor_rollout_ref.rollout.gpu_memory_utilization == 0.25
    assert config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 1
    # verl's defaults and Agent Lightning's overlay are there too
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "per_rollout_mean"
    assert config.trainer.n_gpus_per_node == 8
    assert "verl" in manager.backends.names()


def test_the_backend_override_wins_over_the_yaml(tmp_path, no_autoload):
    path = str(write_config(tmp_path, backend="torch"))
    with pytest.raises(ConfigError) as refused:
        resolve_config(path, [], no_autoload)  # the core schema knows no fsdp_config
    assert refused.value.key.startswith("actor_rollout_ref.actor.")  # a verl-only key
    assert "unknown key" in str(refused.value)
    config, _ = resolve_config(path, ["agentlightning.backend=verl"], no_autoload)
    assert config.agentlightning.backend == "verl"
    assert config.actor_rollout_ref.actor.fsdp_config.param_offload is True


def test_a_misspelt_verl_key_is_refused_by_name(tmp_path, no_autoload):
    with pytest.raises(ConfigError) as refused:
        resolve_config(str(write_config(tmp_path, offload_key="param_ofload")), [], no_autoload)
    assert refused.value.key == "actor_rollout_ref.actor.fsdp_config.param_ofload"
    assert "unknown key" in str(refused.value)


def test_a_verl_type_error_names_the_key(tmp_path, no_autoload):
    with pytest.raises(ConfigError) as refused:
        resolve_config(
            str(write_config(tmp_path)), ["actor_rollout_ref.rollout.gpu_memory_utilization=lots"], no_autoload
        )
    assert refused.value.key == "actor_rollout_ref.rollout.gpu_memory_utilization"


def test_an_unknown_backend_lists_the_registered_ones(tmp_path, no_autoload):
    with pytest.raises(Exception, match=r"unknown backend 'vrel'.*registered: torch, trl, verl"):
        resolve_config(str(write_config(tmp_path)), ["agentlightning.backend=vrel"], no_autoload)


def run_cli(tmp_path, capsys, *overrides):
    code = main(
        [
            "train",
            str(write_config(tmp_path, backend="torch")),
            "backend=verl",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            *overrides,
        ]
    )
    return code, capsys.readouterr().err


def test_cli_backend_verl_takes_verl_keys_and_asks_for_the_agents(tmp_path, capsys, monkeypatch):
    """Without the gateway's URL the agents run embedded, which needs their class."""
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(tmp_path, capsys, "actor_rollout_ref.rollout.name=vllm")
    assert code == 2
    assert "config key agentlightning.local.agent_class" in err and "embedded rollout source" in err


def test_cli_backend_verl_names_a_misspelt_key(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(tmp_path, capsys, "actor_rollout_ref.rollout.gpu_memory_utilisation=0.3")
    assert code == 2
    assert "config key actor_rollout_ref.rollout.gpu_memory_utilisation: unknown key" in err


def test_cli_backend_verl_asks_for_the_rollout_engine(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(tmp_path, capsys, "agentlightning.agl_base_url=http://127.0.0.1:9")
    assert code == 2
    assert "config key actor_rollout_ref.rollout.name" in err


# -- across Ray ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_cli_backend_verl_on_cpu_says_it_needs_gpus(ray_session, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(
        tmp_path,
        capsys,
        "agentlightning.agl_base_url=http://127.0.0.1:9",  # never contacted: the check comes first
        "actor_rollout_ref.rollout.name=vllm",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # the checks before the GPU count pass
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
    )
    assert code == 2
    assert "config key trainer.n_gpus_per_node" in err
    assert "needs trainer.nnodes x trainer.n_gpus_per_node = 1" in err and "which has 0" in err


@pytest.mark.ray
@pytest.mark.slow
def test_steps_stream_from_the_ray_actor_to_on_step_as_they_finish(ray_session):
    """:func:`actor_steps` over a real Ray actor that yields as the task runner does; each step
    reaches ``on_step`` in the driver before the actor has produced the next one."""
    from agl_backend_verl.run import actor_steps

    @ray_session.remote
    class Gate:
        def __init__(self):
            self.seen = 0

        def saw(self, step):
            self.seen = step

        def last_seen(self):
            return self.seen

    @ray_session.remote
    class Runner:
        def run(self, config, plugins):
            import time

            for step in range(3):
                if step:  # wait until the driver has handled the previous step
                    deadline = time.monotonic() + 120
                    while ray_session.get(gate.last_seen.remote()) != step - 1:
                        assert time.monotonic() < deadline, f"step {step - 1} never reached on_step"
                        time.sleep(0.01)
                metrics = {
                    "training/reward": 0.5 * step,
                    "n_keys": float(len(config)),
                    "n_plugins": float(len(plugins)),
                }
                yield (step, 2, metrics, {"trajectories": [{"step": step}]})
            raise RuntimeError("worker lost after step 2")

    gate = Gate.remote()
    seen = []

    def on_step(step, total, metrics, samples):
        seen.append((step, total, dict(metrics), samples))
        ray_session.get(gate.saw.remote(step))

    with pytest.raises(Exception, match="worker lost after step 2"):
        for step, total, metrics, samples in actor_steps(Runner.remote(), {"any": "config"}, ["p"]):
            on_step(step, total, metrics, samples)
    assert [s for s, *_ in seen] == [0, 1, 2]
    assert seen[2] == (2, 2, {"training/reward": 1.0, "n_keys": 1.0, "n_plugins": 1.0}, {"trajectories": [{"step": 2}]})
