"""verl's CPU mode, piece by piece in this process: the platform, the engines found for ``cpu``, the
patch, the config rules and the CPU replica's server (the whole loop runs in
``tests/verl/test_cpu_workers.py`` and ``tests/verl/test_cpu_e2e.py``)."""

from __future__ import annotations

import socket

import httpx
import pytest
import torch

pytestmark = pytest.mark.verl

pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402
from verl.plugin.platform import PlatformRegistry, platform_manager  # noqa: E402

from agl_backend_verl.config import load_verl_config  # noqa: E402
from agl_backend_verl.cpu import (  # noqa: E402
    CPU_KEYS,
    mode,
    patches,  # noqa: E402
)
from agl_backend_verl.cpu.platform import CpuPlatform  # noqa: E402
from agl_backend_verl.run import ray_init_kwargs  # noqa: E402
from agl_core.config import ConfigError  # noqa: E402


@pytest.fixture
def cpu_platform():
    """verl's platform singleton set to the CPU platform for one test, then restored."""
    saved = platform_manager._current_platform
    platform_manager.set_platform(CpuPlatform())
    yield
    platform_manager._current_platform = saved


def cpu_config(*overrides: str):
    return load_verl_config(
        None,
        [
            *CPU_KEYS,
            "actor_rollout_ref.model.path=/models/tiny",
            "agentlightning.agl_base_url=http://127.0.0.1:1",
            *overrides,
        ],
    )


def test_the_cpu_platform_is_registered_by_name_and_never_probed():
    assert PlatformRegistry.get("cpu") is CpuPlatform
    platform = CpuPlatform()
    assert not platform.is_platform_available(use_smi_check=True)  # a GPU machine keeps verl's detection
    assert platform.communication_backend_name() == "gloo"
    assert platform.ray_resource_name() == mode.RANK_RESOURCE
    assert platform.ray_resource_options(0.5) == {"resources": {mode.RANK_RESOURCE: 0.5}}
    device = platform.device_module
    assert device.is_available() and device.memory_reserved() == 0 and device.get_device_name() == "CPU"
    free, total = device.mem_get_info()
    assert 0 < free <= total
    state = device.get_rng_state()
    first = torch.rand(3)
    device.set_rng_state(state)
    assert torch.equal(first, torch.rand(3))


def test_verl_finds_its_fsdp_engines_for_cpu(cpu_platform):
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    from agl_backend_verl.cpu.engines import register_engines

    register_engines()
    register_engines()  # idempotent: verl refuses a second registration of a key
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead
    assert EngineRegistry.get_engine_cls("value_model", "fsdp2") is FSDPEngineWithValueHead


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_gloo_patch_makes_verls_process_group_start_on_cpu(cpu_platform, monkeypatch):
    from verl.utils import distributed

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_agl_patch", False):
        pytest.skip("the patch was applied in this process before the test could see verl's own function")
    with pytest.raises(ValueError, match="Duplicate device type cpu"):
        original()  # verl's own: backend "cpu:gloo,cpu:gloo"
    patches.gloo_process_group(original)()
    try:
        assert torch.distributed.is_initialized() and torch.distributed.get_backend() == patches.CPU_BACKEND
    finally:
        torch.distributed.destroy_process_group()


def test_cpu_keys_load_and_pass_the_cpu_checks():
    config = cpu_config()
    assert mode.is_cpu(config)
    mode.check_cpu_config(config, use_critic=True)
    mode.use_fp32(config)
    for section in mode.ENGINE_SECTIONS:
        assert OmegaConf.select(config, section).mixed_precision == mode.FP32
    assert not mode.is_cpu(
        load_verl_config(None, ["actor_rollout_ref.model.path=/m", "agentlightning.agl_base_url=http://127.0.0.1:1"])
    )


@pytest.mark.parametrize(
    "override, key",
    [
        ("actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.strategy"),
        (
            "actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2",
            "actor_rollout_ref.model.override_config.attn_implementation",
        ),
        ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.name"),
        ("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.use_remove_padding"),
        (
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
        ),
    ],
)
def test_what_cannot_run_on_cpu_is_refused_by_key(override, key):
    with pytest.raises(ConfigError) as error:
        mode.check_cpu_config(cpu_config(override), use_critic=False)
    assert error.value.key == key and "trainer.device=cpu" in str(error.value)


def test_the_critic_keys_are_checked_when_a_critic_is_used():
    config = cpu_config("critic.strategy=fsdp")
    mode.check_cpu_config(config, use_critic=False)
    with pytest.raises(ConfigError, match="critic.strategy"):
        mode.check_cpu_config(config, use_critic=True)


def test_ray_gets_one_rank_resource_per_rank_and_the_cpu_platform_everywhere():
    kwargs = ray_init_kwargs(cpu_config("trainer.n_gpus_per_node=3"))
    assert kwargs["resources"] == {mode.RANK_RESOURCE: 3.0}
    assert kwargs["runtime_env"]["env_vars"][mode.PLATFORM_ENV] == "cpu"
    assert kwargs["num_cpus"] == 12
    gpu = ray_init_kwargs(
        load_verl_config(None, ["actor_rollout_ref.model.path=/m", "agentlightning.agl_base_url=http://127.0.0.1:1"])
    )
    assert "resources" not in gpu and mode.PLATFORM_ENV not in gpu["runtime_env"]["env_vars"]
    with pytest.raises(ConfigError, match="has 1 .*resources=") as error:
        mode.check_ray_resources(cpu_config(), {mode.RANK_RESOURCE: 1.0})
    assert error.value.key == "trainer.n_gpus_per_node"


def test_the_cpu_replica_is_verls_rollout_agl_cpu():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from agl_backend_verl.cpu.replica import CpuReplica, CpuServerAdapter

    assert get_rollout_replica_class("agl_cpu") is CpuReplica
    assert get_rollout_class("agl_cpu", "async") is CpuServerAdapter


def test_the_replica_server_aborts_resumes_and_takes_weights_with_their_step(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agl_backend_verl.cpu.replica import AbortablePolicyServer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    server = AbortablePolicyServer(model, AutoTokenizer.from_pretrained(tiny_model_dir), "tiny")
    server.start()
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 1, "seed": 1, "return_token_ids": True}
    try:
        ok = httpx.post(f"{server.base_url}/completions", json=body, timeout=60).json()["choices"][0]
        assert len(ok["token_ids"]) == len(ok["logprobs"]["token_logprobs"]) > 0
        server.abort()
        assert httpx.post(f"{server.base_url}/completions", json=body, timeout=60).status_code == 503
        server.resume()
        assert httpx.post(f"{server.base_url}/completions", json=body, timeout=60).status_code == 200
        weights = {name: torch.zeros_like(p) for name, p in model.state_dict().items()}
        server.load_weights(weights, version=7)
        assert server.version == 7
        again = httpx.post(f"{server.base_url}/completions", json=body, timeout=60).json()["choices"][0]
        assert again["logprobs"]["token_logprobs"] != ok["logprobs"]["token_logprobs"]  # the new weights serve
        with pytest.raises(ValueError, match="unexpected"):
            server.load_weights({"not.a.weight": torch.zeros(1)}, version=8)
        assert server.version == 7
    finally:
        server.close()


def test_the_value_model_patch_loads_the_critic_with_sdpa(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels = 1
    critic = patches.load_valuehead_model(str(tiny_model_dir), torch.float32, config, False)
    assert critic.config._attn_implementation == "sdpa"
    values = critic(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert values.shape == (1, 3, 1)  # one value per token, as verl's value head gives


def test_the_offload_patch_builds_verls_policy_unpinned():
    from torch.distributed.fsdp import CPUOffloadPolicy

    policy = patches.unpinned_offload_policy(pin_memory=True)
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False
