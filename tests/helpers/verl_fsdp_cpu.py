"""verl 0.9.1's FSDP2 training engine on CPU, in a gloo process group: one mini-batch update with
verl's ``ppo_loss``, beside the torch backend's update of the same mini-batch from the same weights.

verl 0.9.1 has no CPU platform: it falls back to CUDA on a machine without GPUs, and
``EngineRegistry`` registers the FSDP engines for ``cuda`` and ``npu`` only. The verl backend's CPU
platform (:class:`agl_backend_verl.cpu.platform.CpuPlatform`) is set as verl's device platform
(``verl.plugin.platform.set_platform``) and ``VERL_ENGINE_DEVICE=cuda`` picks the engine class; the
engine then runs unchanged, with
``strategy: fsdp2`` (FSDP1 refuses CPU parameters with ``sync_module_states``), SDPA attention
(FlashAttention2 is verl's default) and fp32 mixed precision (verl's default autocasts to bf16).

:func:`run_rank` is one rank's work (spawned by ``tests/verl/test_ppo_loss.py``); every rank writes
what it measured to ``out_dir/rank{N}.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import partial
from pathlib import Path

import torch

from agl_backend_verl.cpu.mode import FP32
from agl_backend_verl.cpu.platform import CpuPlatform

ENGINE_OVERRIDES = (
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.model.override_config.attn_implementation=sdpa",
)


def build_engine(config):
    """verl's FSDP engine for the actor of ``config`` (agl's verl config), initialised, and the
    actor's ``ActorConfig``."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig
    from verl.workers.engine import EngineRegistry

    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    engine_config = dataclasses.replace(actor.engine, mixed_precision=FP32)
    engine_config.micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    engine_config.use_remove_padding = model_config.get("use_remove_padding", False)
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=engine_config.strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=actor.optim,
        checkpoint_config=actor.checkpoint,
    )
    engine.initialize()
    return engine, actor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def full_state(engine, grads: bool = False) -> dict[str, torch.Tensor]:
    """The engine's parameters (or their gradients), gathered from their FSDP shards."""
    return {name: _full(p.grad if grads else p) for name, p in engine.module.named_parameters()}


def run_rank(rank: int, world_size: int, port: int, case: dict, out_dir: str) -> None:
    """Rank ``rank`` of ``world_size``: build the engine, train on its share of the first mini-batch
    of ``case`` (see tests/verl/test_ppo_loss.py), and write the results."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    torch.set_num_threads(1)
    from verl.plugin.platform.platform_manager import set_platform

    set_platform(CpuPlatform())
    from agl_backend_verl.verl_plugins import register_into_verl
    from agl_core.plugins import PluginManager

    register_into_verl(PluginManager(load_entrypoints=False))  # agl's built-in losses, whatever is installed
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _train(rank, world_size, case, Path(out_dir))
    finally:
        torch.distributed.destroy_process_group()


def _train(rank: int, world_size: int, case: dict, out_dir: Path) -> None:
    from transformers import AutoTokenizer
    from verl.utils import tensordict_utils as tu
    from verl.utils.py_functional import rename_dict
    from verl.workers.utils.losses import ppo_loss

    from tests.helpers.step_comparison import compare_steps
    from tests.helpers.verl_local_workers import engine_mini_batch
    from tests.helpers.verl_ppo import (
        policy_and_reference,
        recorded_rollouts,
        torch_update,
        verl_config,
        verl_mini_batch,
    )

    config = verl_config(
        case["model_dir"],
        case["loss"],
        case["normalization"],
        case["entropy"],
        case["kl"],
        *ENGINE_OVERRIDES,
        *case["overrides"],
    )
    engine, actor = build_engine(config)
    before = full_state(engine)
    tokenizer = AutoTokenizer.from_pretrained(case["model_dir"])
    rollouts = recorded_rollouts(json.loads(Path(case["traces"]).read_text())["scenarios"])
    update, prepared, mini, per_mini = torch_update(
        config, policy_and_reference(case["model_dir"]), tokenizer, rollouts
    )
    batch = verl_mini_batch(prepared, mini, per_mini, tokenizer)
    share = per_mini // world_size
    data = engine_mini_batch(batch[rank * share : (rank + 1) * share], actor)
    tu.assign_non_tensor(
        data,
        global_batch_size=per_mini,
        use_remove_padding=engine.engine_config.use_remove_padding,
        use_fused_kernels=False,
    )
    grads: dict[str, torch.Tensor] = {}
    step = engine.optimizer.step

    def step_after_reading_the_gradients(*args, **kwargs):
        grads.update(full_state(engine, grads=True))
        return step(*args, **kwargs)

    engine.optimizer.step = step_after_reading_the_gradients
    with engine.train_mode():
        output = engine.train_batch(data, loss_function=partial(ppo_loss, config=actor))
    after = full_state(engine)
    metrics = {
        k: v.aggregate() if hasattr(v, "aggregate") else float(sum(v) / len(v))
        for k, v in output["metrics"].items()
        if k != "grad_norm"
    }
    metrics = rename_dict(metrics, "actor/")  # as verl's trainer names them
    result = {
        "loss": float(sum(output["loss"])),
        "grad_norm": float(output["metrics"]["grad_norm"]),
        "metrics": metrics,
    }
    if rank == 0:  # the torch backend's step on the whole mini-batch, from the weights the engine started from
        params = dict(update.model.named_parameters())
        assert set(params) == set(before), sorted(set(params) ^ set(before))
        with torch.no_grad():
            for name, value in before.items():
                params[name].copy_(value)
        result["torch"] = update.mini_batch_step(mini)
        result.update(compare_steps(before, after, grads, params))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
