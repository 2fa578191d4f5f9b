"""One recorded training step on the torch backend and through verl's FSDP2 engine on CPU ranks.

Spawned by ``tests/verl/test_backend_differential.py``: every rank runs :func:`run_cases`; rank 0 also
runs the torch backend's side and compares. Both sides start from the same weights (the corridor's
tiny policy, the engine's gathered parameters copied into the torch model) and the same recorded
rollouts, each through its backend's own way to the update:

- torch: :class:`~agl_core.stages.pipeline.StepPipeline` → the torch backend's
  :class:`~agl_core.backends.torch.update.ActorUpdate` (old and reference log-probs, then one
  optimizer step per mini-batch, token-budget micro-batches with ``use_dynamic_bsz``);
- verl: the pipeline as :class:`~agl_backend_verl.trainer.AglRayPPOTrainer` builds it (verl's own
  estimators where the config names one) → the trainer's ``DataProto`` → split as verl's worker
  dispatch splits it (``DataProto.chunk``: a contiguous share of the batch per rank, then that
  share's mini-batches) → verl's FSDP2 engine ``train_batch`` with verl's ``ppo_loss`` per
  mini-batch (its own micro-batches).

With several ranks and several mini-batches that split alone trains other mini-batches than the
torch backend (whose mini-batch ``i`` is rows ``i × per_mini`` onwards), so the rows are reordered
first: ``dispatch: torch_mini_batches`` puts them in
:func:`~agl_backend_verl.dispatch.mini_batch_major_order`, ``dispatch: verl`` in the trainer's own
:func:`~agl_backend_verl.dispatch.dispatch_order` (balanced within each mini-batch, as under
``trainer.balance_batch``), ``dispatch: contiguous`` leaves them as they are.

The old and reference log-probs are the torch side's (the old ones perturbed, so that ratios clip),
handed to both: what is compared is the update, not a second forward pass. ``planted`` plants a known
backend difference on the torch side: the loss gets its settings without ``batch_num_tokens``, so
each micro-batch's token means divide by its own tokens instead of the mini-batch's.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

import attrs
import numpy as np
import torch
from omegaconf import OmegaConf

from tests.helpers.paths import REPO_ROOT
from tests.helpers.verl_fsdp_cpu import ENGINE_OVERRIDES, FP32, CpuPlatform, build_engine, full_state

# The metrics both backends report for an update step, compared between them.
SHARED_METRICS = (
    "actor/pg_loss",
    "actor/entropy_loss",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
)
# Means over micro-batches and ranks on verl's engine, over tokens on the torch backend: equal with
# one micro-batch on one rank only.
MICRO_BATCH_MEANS = ("actor/pg_clipfrac", "actor/ppo_kl")


def case_config(case: dict):
    """agl's verl config of ``case`` (the recorded corridor run's settings and the case's own)."""
    from agl_backend_verl.config import load_verl_config

    micro = (
        [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={case['token_budget']}",
        ]
        if case["token_budget"]
        else [
            "actor_rollout_ref.actor.use_dynamic_bsz=false",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={case['micro_batch_size']}",
        ]
    )
    config = load_verl_config(
        None,
        [
            f"actor_rollout_ref.model.path={case['model_dir']}",
            "agentlightning.agl_base_url=http://127.0.0.1:1",
            f"agentlightning.trace_aggregator.level={case['aggregator']}",
            "agentlightning.trace_aggregator.trajectory_max_prompt_length=256",
            "agentlightning.trace_aggregator.trajectory_max_response_length=256",
            f"agentlightning.loss_normalization={case['normalization']}",
            f"algorithm.adv_estimator={case['estimator']}",
            "algorithm.gamma=0.0",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=8",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={case['mini_batch_size']}",
            f"actor_rollout_ref.actor.policy_loss.loss_mode={case['loss']}",
            "actor_rollout_ref.actor.entropy_coeff=0.1",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.5",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "trainer.device=cpu",
            *ENGINE_OVERRIDES,
            *micro,
        ],
    )
    # The precision both sides train in: build_engine gives verl's engine FP32; the torch backend reads
    # the same key, which verl's config leaves out.
    OmegaConf.update(config, "actor_rollout_ref.actor.fsdp_config.mixed_precision", FP32, force_add=True)
    return config


def case_plugins(case: dict):
    from agl_core.plugins import PluginManager
    from tests.helpers.median_baseline import MedianBaseline

    manager = PluginManager(load_entrypoints=False)
    if case["plugins"]:
        sys.path.insert(0, str(REPO_ROOT / "examples" / "retoken_merge"))
        import agl_retoken_merge

        manager.register(agl_retoken_merge)
        manager.register(MedianBaseline())
    return manager


def run_cases(rank: int, world_size: int, port: int, cases: list[dict], out_dir: str) -> None:
    """Rank ``rank`` of ``world_size``: every case's step on verl's engine; rank 0 also on the torch
    backend, writing ``out_dir/{case id}.json``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    torch.set_num_threads(1)
    from verl.plugin.platform.platform_manager import set_platform

    set_platform(CpuPlatform())
    from agl_backend_verl.verl_plugins import register_into_verl

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for case in cases:
            plugins = case_plugins(case)
            register_into_verl(plugins)
            result = _step(rank, world_size, case, plugins)
            if rank == 0:
                (Path(out_dir) / f"{case['id']}.json").write_text(json.dumps(result))
    finally:
        torch.distributed.destroy_process_group()


def _pipelines(config, plugins, tokenizer, rollouts, step):
    """The step's prepared batch as the torch backend builds it and as the verl trainer does."""
    from agl_backend_verl.advantages import compute_advantages
    from agl_core.stages.pipeline import StepPipeline

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    torch_side = StepPipeline(config, plugins, tokenizer).prepare(rollouts, step)
    verl_side = StepPipeline(
        config, plugins, tokenizer, estimate=lambda rows: compute_advantages(rows, config, plugins, pad)
    ).prepare(rollouts, step)
    assert [r.rollout_id for r in torch_side.shaped.rows] == [r.rollout_id for r in verl_side.shaped.rows]
    return torch_side, verl_side


def _step(rank: int, world_size: int, case: dict, plugins) -> dict:
    from transformers import AutoTokenizer
    from verl.utils import tensordict_utils as tu
    from verl.utils.py_functional import rename_dict
    from verl.workers.utils.losses import ppo_loss

    from agl_backend_verl.dataproto import to_dataproto
    from agl_backend_verl.dispatch import dispatch_order, mini_batch_major_order
    from agl_core.backends.torch.update import ActorSettings, ActorUpdate, make_optimizer
    from agl_core.recording import read_recording
    from agl_core.stages.tensorize import tensorize
    from tests.helpers.verl_local_workers import engine_mini_batch
    from tests.helpers.verl_ppo import policy_and_reference

    config = case_config(case)
    engine, actor = build_engine(config)
    before = full_state(engine)
    tokenizer = AutoTokenizer.from_pretrained(case["model_dir"])
    rollouts = read_recording(case["recording"]).rollouts(case["step"])
    torch_prepared, verl_prepared = _pipelines(config, plugins, tokenizer, rollouts, case["step"])
    n_rows, n_mini = len(torch_prepared.shaped.rows), torch_prepared.shaped.n_mini_batches
    per_mini = n_rows // n_mini

    # The torch backend's update objects; its batch (old and reference log-probs) is handed to both sides.
    model, ref = policy_and_reference(case["model_dir"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(before[name])
    actor_config = config.actor_rollout_ref.actor
    optimizer, _ = make_optimizer(model, actor_config.optim, 1)
    loss_fn = plugins.policy_losses.get(actor_config.policy_loss.loss_mode)
    if case["planted"]:
        configured = loss_fn

        def loss_fn(old, new, advantages, mask, settings):  # the planted difference
            return configured(old, new, advantages, mask, attrs.evolve(settings, batch_num_tokens=None))

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    update = ActorUpdate(
        model, ref, optimizer, loss_fn, ActorSettings.from_config(config.actor_rollout_ref), torch.device("cpu"), pad
    )
    batch = update.batch(torch_prepared)
    noise = 0.3 * torch.randn(batch.old_log_prob.shape, generator=torch.Generator().manual_seed(1))
    batch = attrs.evolve(batch, old_log_prob=batch.old_log_prob + noise * batch.mask)

    # verl: the trainer's DataProto, each rank's contiguous share, that share's mini-batches.
    padded = tensorize(verl_prepared.shaped.rows, pad_token_id=pad)
    data = to_dataproto(padded, meta_info={"temperature": 1.0})
    data.batch["advantages"] = verl_prepared.advantages(padded.tensors["responses"].shape[1])
    data.batch["old_log_probs"] = batch.old_log_prob
    data.batch["ref_log_prob"] = batch.ref_log_prob
    share, per_rank_mini = n_rows // world_size, per_mini // world_size
    if case["dispatch"] == "torch_mini_batches":
        data = data[mini_batch_major_order(n_rows, n_mini, world_size)]
    elif case["dispatch"] == "verl":
        seqlens = data.batch["attention_mask"].sum(-1).tolist()
        data = data[dispatch_order(seqlens, n_mini, world_size, balance=True)[0]]
    mine = data[rank * share : (rank + 1) * share]
    verl_grads, verl_minis = _capture_grads(engine.optimizer, lambda: full_state(engine, grads=True)), []
    for i in range(n_mini):
        mini = engine_mini_batch(mine[i * per_rank_mini : (i + 1) * per_rank_mini], actor)
        tu.assign_non_tensor(
            mini,
            global_batch_size=per_mini,
            use_remove_padding=engine.engine_config.use_remove_padding,
            use_fused_kernels=False,
        )
        with engine.train_mode():
            output = engine.train_batch(mini, loss_function=partial(ppo_loss, config=actor))
        metrics = {
            k: v.aggregate() if hasattr(v, "aggregate") else float(np.mean(v)) for k, v in output["metrics"].items()
        }
        metrics = rename_dict({**metrics, "loss": float(sum(output["loss"]))}, "actor/")  # as verl's trainer names them
        verl_minis.append(metrics)
    after = full_state(engine)
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, verl_minis)
    if rank != 0:
        return {}

    torch_grads = _capture_grads(
        update.optimizer, lambda: {n: p.grad.detach().clone() for n, p in update.model.named_parameters()}
    )
    torch_minis = [
        update.mini_batch_step(batch.rows(slice(start, start + per_mini))) for start in range(0, n_rows, per_mini)
    ]
    torch_after = {n: p.detach().clone() for n, p in update.model.named_parameters()}
    names = SHARED_METRICS + ("actor/loss",)
    # verl's worker: each rank's loss terms are its local sums × dp_size, averaged over the ranks; the
    # trainer averages each metric over the mini-batches, as the torch backend does.
    verl_metrics = {
        n: float(np.mean([np.mean([ranks[i][n] for ranks in gathered]) for i in range(n_mini)])) for n in names
    }
    torch_metrics = {n: float(np.mean([m[n] for m in torch_minis])) for n in names}
    return {
        "dp_size": world_size,
        "n_rows": n_rows,
        "n_mini_batches": n_mini,
        "n_micro_batches": float(np.mean([m["actor/n_micro_batches"] for m in torch_minis])),
        "torch": torch_metrics,
        "verl": verl_metrics,
        **_parameter_differences(before, after, torch_after, verl_grads, torch_grads),
    }


def _capture_grads(optimizer, read):
    """A list that gets the gradients (as ``read`` gathers them) at every ``optimizer.step``."""
    captured: list[dict[str, torch.Tensor]] = []
    step = optimizer.step

    def step_after_reading_the_gradients(*args, **kwargs):
        captured.append(read())
        return step(*args, **kwargs)

    optimizer.step = step_after_reading_the_gradients
    return captured


def _parameter_differences(before, verl_after, torch_after, verl_grads, torch_grads) -> dict[str, float]:
    """The largest differences, relative: of the clipped gradients at each optimizer step (to that
    step's largest gradient element), and of the updated weights (to each tensor's largest weight, and
    to the largest change the step made).

    AdamW moves a weight by about ``lr`` whatever its gradient, dividing by ``sqrt(v) + 1e-8``: where
    the gradient is near that ``eps``, rounding differences of the gradient become differences of the
    step of up to ``lr``. The weights are therefore compared where every step's gradient is above
    1e-6 (``n_weights_compared`` of ``n_weights``); the largest difference anywhere is also reported."""
    with torch.no_grad():
        grad_rel = [
            max(float((v[k] - t[k]).abs().max()) for k in t) / max(float(t[k].abs().max()) for k in t)
            for v, t in zip(verl_grads, torch_grads)
        ]
        names = list(torch_after)
        diff = torch.cat([(verl_after[k] - torch_after[k]).abs().flatten() for k in names])
        scale = torch.cat([torch_after[k].abs().max().expand(torch_after[k].numel()) for k in names])
        above_eps = (
            torch.stack([torch.cat([g[k].abs().flatten() for k in names]) for g in torch_grads]).min(dim=0).values
            > 1e-6
        )
        change = max(float((torch_after[k] - before[k]).abs().max()) for k in names)
        return {
            "n_optimizer_steps": len(torch_grads),
            "rel_grad_diff_per_step": grad_rel,
            "max_rel_param_diff": float((diff / scale)[above_eps].max()),
            "max_param_diff_per_change": float(diff[above_eps].max()) / change,
            "max_param_diff_per_change_anywhere": float(diff.max()) / change,
            "n_weights_compared": int(above_eps.sum()),
            "n_weights": int(diff.numel()),
            "max_param_change": change,
        }
