"""verl's CPU mode, piece by piece in this process: the platform, the engines found for ``cpu``, the
patch, the config rules and the CPU replica's server (the whole loop runs in
``tests/verl/test_cpu_workers.py`` and ``tests/verl/test_two_nodes_e2e.py``)."""

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
    SEPARATE_ASYNC_CPU_KEYS,
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


def separate_async_config(*overrides: str):
    """A CPU separate_async config: two mini-batches of one group per step."""
    return cpu_config(
        *SEPARATE_ASYNC_CPU_KEYS,
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "trainer.v1.separate_async.parameter_sync_step=2",
        *overrides,
    )


def test_separate_async_cpu_keys_load_pass_the_cpu_checks_and_reserve_both_pools():
    config = separate_async_config()
    mode.check_cpu_config(config, use_critic=False)
    assert config.actor_rollout_ref.rollout.checkpoint_engine.backend == mode.CHECKPOINT_ENGINE
    kwargs = ray_init_kwargs(config)
    assert kwargs["resources"] == {mode.RANK_RESOURCE: 4.0}  # the trainer's 2 ranks + the rollout pool's 2
    assert kwargs["num_cpus"] == 16
    with pytest.raises(ConfigError, match=r"\+ actor_rollout_ref.rollout.nnodes x .* = 4 ranks .* has 2") as error:
        mode.check_ray_resources(config, {mode.RANK_RESOURCE: 2.0})
    assert error.value.key == "trainer.n_gpus_per_node"


@pytest.mark.parametrize("backend", ["nccl", "nixl", "naive"])
def test_separate_async_on_cpu_takes_the_gloo_checkpoint_engine_only(backend):
    key = "actor_rollout_ref.rollout.checkpoint_engine.backend"
    if backend == "naive":  # verl's own rule, refused for every device when the config loads
        with pytest.raises(ConfigError, match="only feeds replicas inside the trainer's ranks") as error:
            separate_async_config(f"{key}={backend}")
    else:
        with pytest.raises(ConfigError, match="needs 'agl_gloo': verl's other checkpoint engines need GPUs") as error:
            mode.check_cpu_config(separate_async_config(f"{key}={backend}"), use_critic=False)
    assert error.value.key == key


def test_the_hybrid_modes_on_cpu_take_naive_or_the_gloo_engine():
    key = "actor_rollout_ref.rollout.checkpoint_engine.backend"
    for backend in ("naive", mode.CHECKPOINT_ENGINE):
        mode.check_cpu_config(cpu_config(f"{key}={backend}"), use_critic=False)
    with pytest.raises(ConfigError, match="needs 'naive' or 'agl_gloo'") as error:
        mode.check_cpu_config(cpu_config(f"{key}=nccl"), use_critic=False)
    assert error.value.key == key


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        (["actor_rollout_ref.rollout.nnodes=0"], "actor_rollout_ref.rollout.nnodes", "a pool of their own"),
        (
            ["actor_rollout_ref.rollout.n_gpus_per_node=3"],
            "actor_rollout_ref.rollout.n_gpus_per_node",
            "whole replicas of tensor x data x pipeline parallel size = 2",
        ),
        (
            ["trainer.v1.separate_async.hybrid_rollout.enable_switch=true"],
            "trainer.v1.separate_async.hybrid_rollout.enable_switch",
            "would get no requests",
        ),
        (
            ["actor_rollout_ref.hybrid_engine=false"],
            "actor_rollout_ref.hybrid_engine",
            "unexpected keyword argument 'flush'",
        ),
    ],
)
def test_separate_async_rules_verl_asserts_in_ray_are_refused_by_key_first(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as error:
        separate_async_config(*overrides)
    assert error.value.key == key


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


def test_the_replica_server_holds_or_refuses_requests_while_aborted_and_takes_weights_with_their_step(
    tiny_model_dir,
):
    """verl's partial-rollout gate: an abort holds new requests until the resume (they are then
    served), an abort that rejects refuses them with 503 (those held too); weights load with their step."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agl_backend_verl.cpu.replica import AbortablePolicyServer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    server = AbortablePolicyServer(model, AutoTokenizer.from_pretrained(tiny_model_dir), "tiny")
    server.start()
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 1, "seed": 1, "return_token_ids": True}

    def post():
        return httpx.post(f"{server.base_url}/completions", json=body, timeout=60)

    try:
        ok = post().json()["choices"][0]
        assert len(ok["token_ids"]) == len(ok["logprobs"]["token_logprobs"]) > 0
        with ThreadPoolExecutor(2) as pool:
            server.abort()
            held = pool.submit(post)
            with pytest.raises(TimeoutError):
                held.result(timeout=1.0)  # parked, not answered (a wrong gate answers at once)
            server.resume()
            assert held.result(timeout=60).json()["choices"][0]["token_ids"] == ok["token_ids"]  # same seed
            server.abort()
            held = pool.submit(post)
            with pytest.raises(TimeoutError):
                held.result(timeout=1.0)
            server.abort(reject=True)  # verl takes the replica out of generation: held requests are refused
            assert held.result(timeout=60).status_code == 503
            assert post().status_code == 503
        server.resume()
        assert post().status_code == 200
        weights = {name: torch.zeros_like(p) for name, p in model.state_dict().items()}
        server.load_weights(weights, version=7)
        assert server.version == 7
        again = post().json()["choices"][0]
        assert again["logprobs"]["token_logprobs"] != ok["logprobs"]["token_logprobs"]  # the new weights serve
        with pytest.raises(ValueError, match="unexpected"):
            server.load_weights({"not.a.weight": torch.zeros(1)}, version=8)
        assert server.version == 7
    finally:
        server.close()


def test_the_server_adapter_takes_its_replica_from_verl_or_from_its_rank(monkeypatch, tiny_model_dir):
    """Standalone: verl's CheckpointEngineWorker names the replica; hybrid: the training rank implies it."""
    from agl_backend_verl.cpu.replica import CpuServerAdapter

    config = cpu_config(f"actor_rollout_ref.model.path={tiny_model_dir}").actor_rollout_ref
    rollout, model = config.rollout, config.model  # tensor parallel size 2: replicas of two ranks
    monkeypatch.setenv("RANK", "3")
    hybrid = CpuServerAdapter(config=rollout, model_config=model, device_mesh=None)
    assert (hybrid.replica_rank, hybrid.is_leader_rank) == (1, False)
    monkeypatch.setenv("RANK", "0")
    standalone = CpuServerAdapter(config=rollout, model_config=model, device_mesh=None, replica_rank=4)
    assert (standalone.replica_rank, standalone.is_leader_rank) == (4, True)


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


def test_apply_gives_verls_standalone_replicas_the_cpu_pool_manager_and_copying_saves(monkeypatch):
    from verl.utils import distributed, fsdp_utils, model
    from verl.workers import engine_workers
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.rollout import replica

    from agl_backend_verl.cpu.resources import CpuResourcePoolManager

    patched = [
        (replica, "ResourcePoolManager"),
        (fsdp_utils, "fsdp2_sharded_save_to_cpu"),
        (transformer_impl, "CPUOffloadPolicy"),
        (model, "load_valuehead_model"),
        (distributed, "initialize_global_process_group_ray"),
        (engine_workers, "initialize_global_process_group_ray"),
    ]
    for module, name in patched:  # restored after the test: other tests see verl as it is
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(patches, "APPLIED", [])
    patches.apply()
    patches.apply()  # idempotent
    assert replica.ResourcePoolManager is CpuResourcePoolManager  # used by RolloutReplica.init_standalone
    assert fsdp_utils.fsdp2_sharded_save_to_cpu._agl_patch
    assert len(patches.APPLIED) == len(set(patches.APPLIED))


def test_the_sharded_save_patch_keeps_a_copy_that_later_steps_leave_alone():
    """On CPU, verl's ``shard.detach().cpu()`` is the live parameter: π_old would follow each step."""
    weight = torch.nn.Parameter(torch.ones(3))

    def verls_save(model):  # what fsdp2_sharded_save_to_cpu returns on CPU: the shard itself
        return {"w": (weight.detach().cpu(), "spec")}, "spec"

    saved, spec = patches.copying_sharded_save(verls_save)(None)
    with torch.no_grad():
        weight.add_(1.0)  # an optimizer step
    assert verls_save(None)[0]["w"][0].data_ptr() == weight.data_ptr()  # verl's own keeps no copy on CPU
    assert torch.equal(saved["w"][0], torch.ones(3)) and saved["w"][1] == spec == "spec"
