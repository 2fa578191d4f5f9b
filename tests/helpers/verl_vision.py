"""verl's actor worker on CPU computing old log-probs of vision-language rows, for
``tests/verl/test_vision_rows.py``.

:func:`run_rank` is one gloo rank (spawned by the test): verl's actor ``TrainingWorker`` built as
``ActorRolloutRefWorker.init_model`` builds it (:func:`tests.helpers.verl_fsdp_step.actor_worker`, FSDP2
on the CPU platform) on the tiny Qwen2-VL policy, fed the rows as agl's V1 trainer writes them
(:func:`agl_backend_verl.transfer.training_rows`: ``[4, length]`` positions and ``multi_modal_inputs``
per row) with the extra info verl's ``_compute_old_log_prob`` adds, and its ``infer_batch``; the
log-probs (or the error, by type and message) go to ``out_dir/result.pt``.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch

from tests.helpers.verl_fsdp_cpu import ENGINE_OVERRIDES, FP32, CpuPlatform


def vision_config(model_dir: str, *overrides: str):
    from omegaconf import OmegaConf

    from agl_backend_verl.config import load_verl_config

    config = load_verl_config(
        None,
        [
            f"actor_rollout_ref.model.path={model_dir}",
            "agentlightning.agl_base_url=http://127.0.0.1:1",
            "data.train_batch_size=1",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.use_dynamic_bsz=false",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "trainer.device=cpu",
            *ENGINE_OVERRIDES,
            *overrides,
        ],
    )
    OmegaConf.update(config, "actor_rollout_ref.actor.fsdp_config.mixed_precision", FP32, force_add=True)
    return config


def run_rank(
    rank: int, world_size: int, port: int, model_dir: str, batch_file: str, out_dir: str, overrides: tuple = ()
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    torch.set_num_threads(1)
    from verl.plugin.platform.platform_manager import set_platform

    set_platform(CpuPlatform())
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    result: dict = {}
    try:
        result = _log_probs(model_dir, batch_file, overrides)
    except Exception as exc:  # the test asserts on what failed, by name
        result = {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    finally:
        torch.distributed.destroy_process_group()
    if rank == 0:
        torch.save(result, Path(out_dir) / "result.pt")


def _log_probs(model_dir: str, batch_file: str, overrides: tuple) -> dict:
    from verl.utils import tensordict_utils as tu

    from agl_backend_verl.transfer import training_rows
    from tests.helpers.verl_fsdp_step import actor_worker

    padded = torch.load(batch_file, weights_only=False)
    config = vision_config(model_dir, *overrides)
    worker = actor_worker(config)
    n_rows, width = len(padded), padded.tensors["responses"].shape[1]
    zeros = torch.zeros(n_rows, width)
    rows = training_rows(padded, list(range(n_rows)), zeros, zeros)
    lengths = rows["input_ids"].offsets().diff().tolist()
    # What verl's _compute_old_log_prob and tqbridge put beside the rows.
    tu.assign_non_tensor(rows, calculate_entropy=True, compute_loss=False, temperature=1.0, global_token_num=lengths)
    worker.engine_config.infer_micro_batch_size_per_gpu = n_rows  # one micro-batch: all rows
    output = worker.infer_batch(rows)
    log_probs = output["log_probs"]
    return {"log_probs": [t.detach().float() for t in log_probs.unbind()], "n_rows": n_rows}
