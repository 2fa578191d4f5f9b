"""One recorded training step on the torch backend and through verl's V1 update path on CPU ranks.

Spawned by ``tests/verl/test_backend_differential.py``: every rank runs :func:`run_cases`; rank 0 also
runs the torch backend's side and compares. Both sides start from the same weights (the corridor's
tiny policy, the verl actor's gathered parameters copied into the torch model) and the same recorded
rollouts, each through its backend's own way to the update:

- torch: :class:`~agl_core.stages.pipeline.StepPipeline` → the torch backend's
  :class:`~agl_core.backends.torch.update.ActorUpdate` (old and reference log-probs, then one
  optimizer step per mini-batch, token-budget micro-batches with ``use_dynamic_bsz``);
- verl: the pipeline as agl's V1 trainer builds it (verl's own estimators where the config names
  one) → the rows as the trainer hands them to verl (:func:`agl_backend_verl.transfer.training_rows`:
  nested fields, in the dispatch order) with the old and reference log-probs in the layout verl's
  ``_compute_old_log_prob`` / ``_compute_ref_log_prob`` write (nested over each row's response:
  ``response_to_nested``) → each rank's contiguous share (as verl's dispatch cuts it) with the extra
  info verl's V1 ``_update_actor`` puts on the batch (taken from verl's own method) → verl's actor
  ``TrainingWorker`` built as ``ActorRolloutRefWorker.init_model`` builds it, its
  ``train_mini_batch`` (mini-batches cut by ``tu.make_iterator``, the FSDP2 engine's
  ``train_batch`` with verl's ``ppo_loss``) → the metrics as ``_update_actor`` reduces them.

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
from tests.helpers.verl_fsdp_cpu import ENGINE_OVERRIDES, FP32, CpuPlatform, full_state

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
    # The precision both sides train in: verl's engine takes it from this key (fp32), as the torch
    # backend does; verl's config leaves it out.
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
    """Rank ``rank`` of ``world_size``: every case's step on verl's actor worker; rank 0 also on the torch
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


def actor_worker(config):
    """verl's actor ``TrainingWorker`` as ``ActorRolloutRefWorker.init_model`` builds it from
    ``config`` (its engine settings from the actor's), initialised, with verl's ``ppo_loss``."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import ppo_loss

    section = config.actor_rollout_ref.actor
    actor = omega_conf_to_dataclass(section)
    actor.model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    training = TrainingWorkerConfig(
        model_type="language_model",
        model_config=actor.model_config,
        engine_config=actor.engine,
        optimizer_config=actor.optim,
        checkpoint_config=actor.checkpoint,
    )
    engine = training.engine_config
    engine.use_dynamic_bsz = section.use_dynamic_bsz
    engine.max_token_len_per_gpu = section.ppo_max_token_len_per_gpu
    engine.micro_batch_size_per_gpu = section.ppo_micro_batch_size_per_gpu
    engine.use_remove_padding = actor.model_config.get("use_remove_padding", False)
    worker = TrainingWorker(config=training)
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    return worker


def update_actor_extra_info(config) -> dict:
    """The extra info verl's V1 ``_update_actor`` puts on the batch it hands the actor worker group
    (verl's own method, run with a stand-in worker group that keeps it)."""
    from types import SimpleNamespace

    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.utils import tensordict_utils as tu

    seen: dict = {}

    def update_actor(batch):
        seen.update(batch.extra_info)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"mfu": [0.0]}})

    group = SimpleNamespace(update_actor=update_actor)
    PPOTrainer._update_actor(SimpleNamespace(config=config, actor_rollout_wg=group), KVBatchMeta(), {})
    return seen


def actor_metrics(output) -> dict[str, float]:
    """What verl's V1 ``_update_actor`` logs of the actor worker's ``train_mini_batch`` output: the
    names prefixed ``actor/``, each averaged over the mini-batches (``reduce_metrics``)."""
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    metrics = rename_dict(dict(output["metrics"]), "actor/")
    metrics.pop("actor/mfu", None)
    return {k: float(v) for k, v in reduce_metrics(metrics).items()}


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
    from verl.workers.utils.padding import response_to_nested

    from agl_backend_verl.dispatch import dispatch_order, mini_batch_major_order
    from agl_backend_verl.transfer import training_rows
    from agl_core.backends.ppo import make_optimizer, mini_batches
    from agl_core.backends.torch.update import ActorSettings, ActorUpdate
    from agl_core.files.recording import read_recording
    from agl_core.stages.tensorize import tensorize
    from tests.helpers.verl_ppo import policy_and_reference

    config = case_config(case)
    worker = actor_worker(config)
    before = full_state(worker.engine)
    tokenizer = AutoTokenizer.from_pretrained(case["model_dir"])
    rollouts = read_recording(case["recording"]).rollouts(case["step"])
    torch_prepared, verl_prepared = _pipelines(config, plugins, tokenizer, rollouts, case["step"])
    n_rows, n_mini = len(torch_prepared.shaped.rows), torch_prepared.shaped.n_mini_batches

    # The torch backend's update objects; its batch (old and reference log-probs) is handed to both sides.
    model, ref = policy_and_reference(case["model_dir"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(before[name])
    actor_config = config.actor_rollout_ref.actor
    optimizer = make_optimizer(model, actor_config.optim)
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

    # verl: the rows as agl's V1 trainer writes them, each rank's contiguous share, verl's train_mini_batch.
    padded = tensorize(verl_prepared.shaped.rows, pad_token_id=pad)
    width = padded.tensors["responses"].shape[1]
    order = list(range(n_rows))
    if case["dispatch"] == "torch_mini_batches":
        order = mini_batch_major_order(n_rows, n_mini, world_size)
    elif case["dispatch"] == "verl":
        order = dispatch_order(padded.tensors["attention_mask"].sum(-1).tolist(), n_mini, world_size, balance=True)[0]
    rows = training_rows(padded, order, verl_prepared.advantages(width), verl_prepared.returns(width))
    rows["old_log_probs"] = response_to_nested(batch.old_log_prob[order], rows["response_mask"])
    rows["ref_log_prob"] = response_to_nested(batch.ref_log_prob[order], rows["response_mask"])
    share = n_rows // world_size  # verl's dispatch hands each rank its contiguous share (BatchMeta.chunk)
    mine = tu.index_select_tensor_dict(rows, torch.arange(rank * share, (rank + 1) * share))
    tu.assign_non_tensor(mine, **update_actor_extra_info(config))  # as verl's tqbridge hands them over
    verl_grads = _capture_grads(worker.engine.optimizer, lambda: full_state(worker.engine, grads=True))
    output = worker.train_mini_batch(mine)
    after = full_state(worker.engine)
    if rank != 0:
        return {}
    verl_metrics = actor_metrics(output)

    torch_grads = _capture_grads(
        update.step.optimizer, lambda: {n: p.grad.detach().clone() for n, p in update.model.named_parameters()}
    )
    torch_minis = [update.mini_batch_step(batch.rows(rows)) for rows in mini_batches(n_rows, n_mini)]
    torch_after = {n: p.detach().clone() for n, p in update.model.named_parameters()}
    names = SHARED_METRICS + ("actor/loss",)
    # verl's trainer averages each metric over the mini-batches (reduce_metrics), as the torch backend does
    torch_metrics = {n: float(np.mean([m[n] for m in torch_minis])) for n in names}
    return {
        "dp_size": world_size,
        "n_rows": n_rows,
        "n_mini_batches": n_mini,
        "n_micro_batches": float(np.mean([m["actor/n_micro_batches"] for m in torch_minis])),
        "torch": torch_metrics,
        "verl": {n: verl_metrics[n] for n in names},
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
