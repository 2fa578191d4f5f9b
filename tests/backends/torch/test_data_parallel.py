"""The torch backend's update split over two data-parallel processes equals its single-process update.

Two processes (``torch.distributed``, gloo on 127.0.0.1) each hold the tiny Qwen2 of the fixtures in
``DistributedDataParallel``, which averages the gradients over the ranks. One mini-batch, from
:class:`~agl_core.stages.pipeline.StepPipeline` (rollouts with several rows, normalised over the
whole batch), is split in halves, rows of one rollout landing on both ranks. Each rank runs
:meth:`~agl_core.backends.torch.update.ActorUpdate.mini_batch_step` on its half with ``dp_size=2``
and ``batch_num_tokens`` the mini-batch's trained tokens in ``LossSettings``: ``per_rollout_mean``'s
``× dp_size``, and the global token count of ``token_mean`` and of the entropy and KL token means,
cancel the averaging. Rank 0 also steps a copy of the model on the whole mini-batch in one process.
Tolerances (fp32): loss terms, gradient norm and clipped gradients within 1e-5 relative; weights
after the AdamW step within 1e-6 (the step is about lr = 1e-3) where the gradient exceeds 1e-6.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

from agl_core.backends.ppo import make_optimizer
from agl_core.backends.torch.backend import load_policy
from agl_core.backends.torch.update import ActorSettings, ActorUpdate
from agl_core.config import load_config
from agl_core.data import CompletedRollout, Triplet
from agl_core.plugins import PluginManager
from agl_core.serving.processes import free_port
from agl_core.stages.pipeline import StepPipeline
from tests.helpers.step_comparison import compare_steps

RTOL = 1e-5
CASES = {  # name: (loss_mode, loss_normalization, use_kl_loss)
    "per_rollout_mean-rollouts": ("per_rollout_mean", "rollouts", False),
    "per_rollout_mean-upstream": ("per_rollout_mean", "upstream", True),
    "token_mean": ("token_mean", "rollouts", True),
}


def rollouts() -> list[CompletedRollout]:
    """Two groups of four rollouts; rollouts 0 and 4 make two calls that do not continue each other
    (two rows each), the others one call (one row)."""
    rng = np.random.default_rng(0)
    out = []
    for k in range(8):
        calls = 2 if k % 4 == 0 else 1
        triplets = [
            Triplet(prompt_ids=rng.integers(3, 1000, 6 + k), response_ids=rng.integers(3, 1000, 3 + (k + c) % 5))
            for c in range(calls)
        ]
        out.append(
            CompletedRollout(
                rollout_id=f"r{k}",
                group_id=f"g{k // 4}",
                state="succeeded",
                triplets=triplets,
                final_reward=float(k % 4 == 1) + 0.1 * k,
            )
        )
    return out


def config(model_dir: str, loss: str, normalization: str, kl: bool):
    return load_config(
        overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            "agentlightning.trace_aggregator.level=trajectory",
            f"agentlightning.loss_normalization={normalization}",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}",
            "actor_rollout_ref.actor.entropy_coeff=0.1",
            f"actor_rollout_ref.actor.use_kl_loss={str(kl).lower()}",
            "actor_rollout_ref.actor.kl_loss_coef=0.5",
            "actor_rollout_ref.actor.optim.lr=1e-3",
        ]
    )


def actor_update(cfg, model, ref, dp_size: int = 1, batch_num_tokens: int | None = None) -> ActorUpdate:
    actor = cfg.actor_rollout_ref.actor
    settings = ActorSettings.from_config(cfg.actor_rollout_ref)
    settings = attrs.evolve(
        settings, loss=attrs.evolve(settings.loss, dp_size=dp_size, batch_num_tokens=batch_num_tokens)
    )
    loss_fn = PluginManager(load_entrypoints=False).policy_losses.get(actor.policy_loss.loss_mode)
    optimizer = make_optimizer(model, actor.optim)
    return ActorUpdate(model, ref if actor.use_kl_loss else None, optimizer, loss_fn, settings, torch.device("cpu"), 0)


def one_case(rank: int, model_dir: str, case: str) -> dict:
    """Rank ``rank``'s half of the mini-batch through DDP; rank 0 also the whole of it in one process."""
    loss, normalization, kl = CASES[case]
    cfg = config(model_dir, loss, normalization, kl)
    torch.manual_seed(0)
    model, ref = load_policy(model_dir, torch.device("cpu")), load_policy(model_dir, torch.device("cpu"), frozen=True)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    prepared = StepPipeline(cfg, PluginManager(load_entrypoints=False)).prepare(rollouts(), step=1)
    assert prepared.shaped.n_mini_batches == 1 and len(prepared.shaped.rows) == 8
    batch = actor_update(cfg, model, ref).batch(prepared)
    noise = 0.3 * torch.randn(batch.old_log_prob.shape, generator=torch.Generator().manual_seed(1))
    batch = attrs.evolve(batch, old_log_prob=batch.old_log_prob + noise * batch.mask)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    update = actor_update(cfg, ddp, ref, dp_size=2, batch_num_tokens=int(batch.mask.sum()))
    result = {"metrics": update.mini_batch_step(batch.rows(slice(4 * rank, 4 * rank + 4)))}
    if rank == 0:
        single = load_policy(model_dir, torch.device("cpu"))
        result["single"] = actor_update(cfg, single, ref).mini_batch_step(batch)
        after = {k: v.detach() for k, v in model.named_parameters()}
        grads = {k: v.grad for k, v in model.named_parameters()}
        result.update(compare_steps(before, after, grads, dict(single.named_parameters())))
    result["rollouts_on_both_ranks"] = sorted(
        {r.rollout_id for r in prepared.shaped.rows[:4]} & {r.rollout_id for r in prepared.shaped.rows[4:]}
    )
    return result


def run_rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = {case: one_case(rank, model_dir, case) for case in CASES}
    finally:
        torch.distributed.destroy_process_group()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    torch.multiprocessing.spawn(run_rank, args=(free_port(), str(tiny_model_dir), str(out)), nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_step_as_one_process_does(ranks, case):
    rank0, rank1 = ranks[0][case], ranks[1][case]
    single = rank0["single"]
    # each rank's loss terms are its half's share × dp_size: their mean over the ranks is the mini-batch's
    for name in ("actor/pg_loss", "actor/entropy_loss", "actor/loss", *(["actor/kl_loss"] if CASES[case][2] else [])):
        mean = (rank0["metrics"][name] + rank1["metrics"][name]) / 2
        assert mean == pytest.approx(single[name], rel=RTOL, abs=1e-8), name
    assert rank0["metrics"]["actor/grad_norm"] == pytest.approx(single["actor/grad_norm"], rel=RTOL)
    assert rank0["metrics"]["actor/grad_norm"] == rank1["metrics"]["actor/grad_norm"]  # DDP synced the gradients
    assert rank0["max_grad_diff"] <= RTOL * rank0["max_grad"]
    assert rank0["max_param_change"] > 5e-4 and rank0["max_param_diff"] <= 1e-6
    assert rank0["rollouts_on_both_ranks"], "a rollout's rows are split over the ranks"
