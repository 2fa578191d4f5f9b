"""The patches of verl 0.9.1 that CPU mode needs, each replacing one verl call (listed in docs/verl-backend.md).

Applied by :func:`apply` in CPU processes only (``VERL_PLATFORM=cpu``), once; :data:`APPLIED` names them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CPU_BACKEND = "cpu:gloo"
APPLIED: list[str] = []


def gloo_process_group(original: Callable[..., Any]) -> Callable[..., Any]:
    """``verl.utils.distributed.initialize_global_process_group_ray`` with ``backend="cpu:gloo"`` by
    default: verl builds ``f"cpu:gloo,{device}:{backend}"``, which on CPU is ``cpu:gloo,cpu:gloo`` and
    torch refuses (``ValueError: Duplicate device type cpu in backend string: gloo``)."""

    def initialize_global_process_group_ray(timeout_second: Any = None, backend: str | None = None) -> Any:
        return original(timeout_second=timeout_second, backend=backend or CPU_BACKEND)

    initialize_global_process_group_ray._agl_patch = True  # type: ignore[attr-defined]
    return initialize_global_process_group_ray


def load_valuehead_model(local_path: str, torch_dtype: Any, model_config: Any, trust_remote_code: bool) -> Any:
    """``verl.utils.model.load_valuehead_model`` loading the critic with SDPA attention: verl asks
    transformers for ``attn_implementation="flash_attention_2"`` whatever the config says, which
    fails without flash-attn, and then reports ``RuntimeError: model(...) is not a value head
    model, please install trl to make it valid``. Same model class (``AutoModelForTokenClassification``),
    same arguments otherwise."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path,
        torch_dtype=torch_dtype,
        config=model_config,
        attn_implementation="sdpa",
        trust_remote_code=trust_remote_code,
    )


def unpinned_offload_policy(**kwargs: Any) -> Any:
    """``torch.distributed.fsdp.CPUOffloadPolicy`` as verl's FSDP engine builds it
    (``verl.workers.engine.fsdp.transformer_impl.CPUOffloadPolicy``), without pinned memory: verl
    asks for ``CPUOffloadPolicy(pin_memory=True)`` for the reference model (``forward_only``), and
    pinning needs an accelerator (``RuntimeError: Cannot access accelerator device when none is
    available.``). On CPU the offload itself moves nothing."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(**{**kwargs, "pin_memory": False})


def copying_sharded_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """``verl.utils.fsdp_utils.fsdp2_sharded_save_to_cpu`` returning copies: it keeps each rank's shard
    as ``shard.detach().cpu()``, which copies from a GPU but on CPU is the parameter's own storage,
    so the snapshot the separate_async trainer takes of π_old (``DetachActorWorker.save_model_to_cpu``)
    would follow every optimizer step and its old log-probs would be the current policy's."""

    def fsdp2_sharded_save_to_cpu(model: Any) -> Any:
        shards, spec = original(model)
        return {name: (shard.clone(), shard_spec) for name, (shard, shard_spec) in shards.items()}, spec

    fsdp2_sharded_save_to_cpu._agl_patch = True  # type: ignore[attr-defined]
    return fsdp2_sharded_save_to_cpu


def apply() -> None:
    """Apply every patch (idempotent)."""
    from verl.utils import distributed, fsdp_utils, model
    from verl.workers import engine_workers
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.rollout import replica

    from agl_backend_verl.cpu.resources import CpuResourcePoolManager

    if transformer_impl.CPUOffloadPolicy is not unpinned_offload_policy:
        transformer_impl.CPUOffloadPolicy = unpinned_offload_policy  # imported by name there
        APPLIED.append("verl.workers.engine.fsdp.transformer_impl.CPUOffloadPolicy")

    if model.load_valuehead_model is not load_valuehead_model:
        model.load_valuehead_model = load_valuehead_model  # imported from there at call time
        APPLIED.append("verl.utils.model.load_valuehead_model")

    if not getattr(distributed.initialize_global_process_group_ray, "_agl_patch", False):
        patched = gloo_process_group(distributed.initialize_global_process_group_ray)
        distributed.initialize_global_process_group_ray = patched
        engine_workers.initialize_global_process_group_ray = patched  # imported by name there
        APPLIED.append("verl.utils.distributed.initialize_global_process_group_ray")

    if replica.ResourcePoolManager is not CpuResourcePoolManager:
        replica.ResourcePoolManager = CpuResourcePoolManager  # imported by name there, for init_standalone
        APPLIED.append("verl.workers.rollout.replica.ResourcePoolManager")

    if not getattr(fsdp_utils.fsdp2_sharded_save_to_cpu, "_agl_patch", False):
        fsdp_utils.fsdp2_sharded_save_to_cpu = copying_sharded_save(fsdp_utils.fsdp2_sharded_save_to_cpu)
        APPLIED.append("verl.utils.fsdp_utils.fsdp2_sharded_save_to_cpu")  # imported from there at call time
