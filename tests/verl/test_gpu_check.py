"""What ``scripts/gpu_check.py`` and ``examples/corridor/run_verl.sh`` would hand verl on a GPU, checked on CPU.

The GPU run cannot train here (vLLM needs a GPU), so the exact command ``gpu_check`` runs
(``tests.helpers.verl_e2e.train_command`` with its GPU keys) is executed with a stand-in python
that records its arguments; those are then resolved as ``agl train`` resolves them and put through
verl's own checks (``validate_config`` and the worker config dataclasses, which load the built
policy), so every key exists, has verl's type and fits one GPU.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.verl

pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402

from agl_core.plugins import DISABLE_AUTOLOAD_ENV  # noqa: E402
from agl_core.runs.run_config import resolve_config  # noqa: E402
from tests.helpers.paths import REPO_ROOT  # noqa: E402

GPU_CHECK = REPO_ROOT / "scripts" / "gpu_check.py"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    return load_gpu_check()


@pytest.fixture(scope="module")
def policy_dir(gpu_check, tmp_path_factory):
    return gpu_check.build(tmp_path_factory.mktemp("corridor") / "policy", seed=0)


def recorded_train_args(command: list[str], env: dict[str, str], tmp_path: Path) -> list[str]:
    """Run ``command`` with a python that only writes down its arguments; return them."""
    shim = tmp_path / "python"
    out = tmp_path / "args.txt"
    shim.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {out}\n")
    shim.chmod(0o755)
    result = subprocess.run(command, env={**env, "PYTHON": str(shim)}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return out.read_text().splitlines()


@pytest.fixture
def gpu_check_config(gpu_check, policy_dir, tmp_path, monkeypatch):
    from tests.helpers.verl_e2e import train_command

    command, env = train_command(
        "http://127.0.0.1:4747", "gpu-key", policy_dir, tmp_path / "run", 2, 1, *gpu_check.GPU_KEYS
    )
    args = recorded_train_args(command, env, tmp_path)
    assert args[:3] == ["-m", "agl_core.cli", "train"]
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    config, _ = resolve_config(str(REPO_ROOT / args[3]), args[4:])
    return config


def test_gpu_check_runs_verl_on_one_gpu_with_vllm(gpu_check_config, policy_dir, tmp_path):
    config = gpu_check_config
    assert config.agentlightning.backend == "verl"
    assert config.agentlightning.agl_base_url == "http://127.0.0.1:4747"
    assert config.agentlightning.agl_key == "gpu-key"
    assert config.agentlightning.local.agent_class == "examples.corridor.agent:CorridorAgent"
    assert dict(config.agentlightning.local.env_map) == {"CORRIDOR_SIGNS": "input.signs"}
    assert config.actor_rollout_ref.model.path == str(policy_dir)
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.name, rollout.tensor_model_parallel_size, rollout.n) == ("vllm", 1, 4)
    assert 0 < rollout.gpu_memory_utilization <= 0.5
    assert rollout.max_model_len >= config.data.max_prompt_length + config.data.max_response_length
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (1, 1)
    assert config.trainer.total_training_steps == 2
    assert config.trainer.default_local_dir == str(tmp_path / "run")
    assert list(config.trainer.logger) == ["console"]
    assert (REPO_ROOT / config.data.train_files).is_file() and (REPO_ROOT / config.data.val_files).is_file()


def test_verl_accepts_the_gpu_check_config(gpu_check_config, policy_dir):
    """verl's own validation and worker config dataclasses, as its task runner builds them."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    config = gpu_check_config
    OmegaConf.resolve(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    model = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    assert model.hf_config._attn_implementation == "sdpa"  # no flash-attn needed
    assert (
        model.hf_config.num_attention_heads and model.hf_config.hidden_size // model.hf_config.num_attention_heads >= 32
    )
    assert omega_conf_to_dataclass(config.actor_rollout_ref.rollout).max_model_len == 512
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert actor.ppo_micro_batch_size_per_gpu == 2 and actor.ppo_mini_batch_size == 1


def test_run_verl_asks_for_the_model_path(tmp_path):
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "examples" / "corridor" / "run_verl.sh")],
        env={"PATH": "/usr/bin:/bin", "AGL_BASE_URL": "http://127.0.0.1:4747"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "MODEL_PATH" in result.stderr


def test_check_rows_wants_the_steps_with_finite_metrics_and_every_rollout_traced():
    from tests.helpers.verl_e2e import BATCH, SHARED_METRICS, N, check_rows

    good = {name: 1.0 for name in SHARED_METRICS} | {
        "training/n_rollouts": BATCH * N,
        "training/n_rollouts_w_trace": BATCH * N,
    }
    good["training/async/n_calls_wo_model_version"] = 0
    assert check_rows([{"step": 1, **good}, {"step": 2, **good}], [1, 2]) == []
    # one step only, its loss NaN (agl train writes it as null), two rollouts without a trace
    problems = check_rows(
        [{**good, "step": 1, "actor/pg_loss": None, "training/n_rollouts_w_trace": BATCH * N - 2}], [1, 2]
    )
    assert len(problems) == 3
    assert "steps logged: [1]" in problems[0]
    assert f"traced {BATCH * N - 2}" in problems[1]
    assert "actor/pg_loss = None" in problems[2]
    # a failed rollout is a problem, also in a resumed run's first step (its groups run again)
    assert "failed 1" in check_rows([{**good, "step": 1, "training/rollouts/n_failed": 1.0}], [1])[0]
    assert (
        "lacks ['actor/lr']" in check_rows([{k: v for k, v in {"step": 1, **good}.items() if k != "actor/lr"}], [1])[0]
    )
    # zero gradients are a problem only in a step with a group whose rewards differ
    flat = {**good, "actor/grad_norm": 0.0, "training/n_groups": BATCH}
    assert check_rows([{**flat, "step": 1, "training/n_zero_adv_groups": BATCH}], [1]) == []
    assert "zero gradients" in check_rows([{**flat, "step": 1, "training/n_zero_adv_groups": 0}], [1])[0]
