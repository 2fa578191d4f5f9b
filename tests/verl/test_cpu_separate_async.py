"""verl's ``separate_async`` trainer in CPU mode: the trainer's two gloo ranks and a standalone CPU
replica in separate ``verl_cpu_rank`` pools of one machine (a Ray of agl's own), the weights pushed
over the gloo checkpoint engine, two steps of the corridor agents through the real gateway and
controller on 127.0.0.1 (the async gateway source, drained when each step ends). The other trainer
modes run end to end on two nodes: ``tests/verl/test_two_nodes_e2e.py``."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.gateway, pytest.mark.slow]

pytest.importorskip("ray")
pytest.importorskip("verl")

import ray  # noqa: E402

from agl_backend_verl.config import load_verl_config  # noqa: E402
from agl_backend_verl.cpu import CPU_KEYS, SEPARATE_ASYNC_CPU_KEYS  # noqa: E402
from agl_backend_verl.cpu.replica import server_name  # noqa: E402
from agl_backend_verl.run import train  # noqa: E402
from agl_core.plugins.manager import DISABLE_AUTOLOAD_ENV  # noqa: E402
from examples.corridor.build_policy import build  # noqa: E402
from tests.helpers.paths import REPO_ROOT  # noqa: E402
from tests.helpers.verl_e2e import Stack, check_rows  # noqa: E402

STEPS = 2
CORRIDOR = REPO_ROOT / "examples" / "corridor"


def replica_servers() -> dict[str, dict[str, int]]:
    """Version and weight pushes of every CPU replica server of the running job, by actor name."""
    names = [name for name in ray.util.list_named_actors() if name.startswith("agl_cpu")]  # this job's
    return {name: ray.get(ray.get_actor(name).stats.remote()) for name in names}


def test_two_separate_async_steps_on_cpu_push_each_steps_weights_to_the_standalone_replica(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    policy = build(tmp_path / "policy", seed=0)
    with Stack(policy, tmp_path) as stack:
        steps = separate_async_steps(policy, stack, tmp_path)
    assert [step for step, _, _ in steps] == [1, 2]
    problems = check_rows([{"step": step, **metrics} for step, metrics, _ in steps], [1, 2])
    assert not problems, "\n".join(problems)
    for step, _, servers in steps:
        # the standalone replica (rank 1: after the trainer's own) has taken the weights at start (version 0)
        # and after each step, tagged with the step; the trainer's replica, which agl's agents never call
        # and verl lends to generation only to validate, kept those of the start
        pushed = {name: {k: stats[k] for k in ("version", "weight_pushes")} for name, stats in servers.items()}
        assert pushed == {
            server_name(0): {"version": 0, "weight_pushes": 1},
            server_name(1): {"version": step, "weight_pushes": step + 1},
        }, (step, servers)
    assert os.environ.get("VERL_PLATFORM") is None  # the CPU platform is the Ray workers', not the driver's


def separate_async_steps(policy, stack, tmp_path) -> list[tuple[int, dict[str, float], dict[str, dict[str, int]]]]:
    """Train the steps in this process; each step's metrics and the replica servers' stats after it."""
    config = load_verl_config(
        CORRIDOR / "config.yaml",
        [
            *CPU_KEYS,
            *SEPARATE_ASYNC_CPU_KEYS,
            "agentlightning.backend=verl",
            f"agentlightning.agl_base_url={stack.gateway.url}",
            f"agentlightning.agl_key={stack.gateway.key}",
            "agentlightning.gateway.pause_retry_after_seconds=1",
            "ray_kwargs.ray_init.address=local",  # a Ray of agl's own, whatever else runs on this machine
            f"actor_rollout_ref.model.path={policy}",
            f"data.train_files={CORRIDOR / 'dataset.jsonl'}",
            f"data.val_files={CORRIDOR / 'val.jsonl'}",
            "data.train_batch_size=2",
            "trainer.v1.separate_async.parameter_sync_step=2",  # two mini-batches of one group per step
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "data.max_prompt_length=256",
            "data.max_response_length=256",
            f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=-1",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    steps: list[tuple[int, dict[str, float], dict[str, dict[str, int]]]] = []

    def on_step(step, total, metrics, samples=None):
        steps.append((step, metrics, replica_servers()))  # the trainer's actor, and its replicas, still run

    try:
        train(config, on_step=on_step)
    finally:
        ray.shutdown()
    return steps
