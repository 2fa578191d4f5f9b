"""The torch backend's update and verl's actor inputs on the same batch of recorded gateway traces:
both sides of the comparison with verl's ``ppo_loss``, in the test process and on FSDP ranks."""

from __future__ import annotations

import attrs
import torch

from agl_backend_verl.config import load_verl_config
from agl_backend_verl.dataproto import to_dataproto
from agl_core.backends.ppo import make_optimizer
from agl_core.backends.torch.backend import load_policy
from agl_core.backends.torch.update import ActorSettings, ActorUpdate
from agl_core.data import CompletedRollout, Triplet
from agl_core.plugins import PluginManager
from agl_core.stages.pipeline import StepPipeline
from agl_core.stages.tensorize import tensorize

SCENARIOS = (
    "multiturn_4",
    "multiturn_3_history_rewrite",
    "single_turn",
    "tito_multiturn_prefix_stable",
    "no_reward",
    "several_rewards_last_wins",
    "upstream_error_then_ok",
    "completions_api",
)
REWARDS = (1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.5)


def recorded_rollouts(traces):
    """Two groups of four rollouts, each the model calls of one recorded scenario."""
    out = []
    for k, (scenario, reward) in enumerate(zip(SCENARIOS, REWARDS)):
        calls = [e["data"] for e in traces[scenario]["events_triplet"] if e["event_type"] == "model_request"]
        triplets = [
            Triplet(
                prompt_ids=c["prompt_token_ids"],
                response_ids=c["response_token_ids"],
                response_log_probs=c["response_log_probs"],
            )
            for c in calls
            if c["response_token_ids"]
        ]
        out.append(
            CompletedRollout(
                rollout_id=scenario, group_id=f"g{k // 4}", state="succeeded", triplets=triplets, final_reward=reward
            )
        )
    return out


def policy_and_reference(model_dir):
    """The policy, and a perturbed frozen copy as the reference (so the KL term is not zero)."""
    torch.manual_seed(0)
    ref = load_policy(model_dir, torch.device("cpu"), frozen=True)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return load_policy(model_dir, torch.device("cpu")), ref


def verl_config(tiny_model_dir, loss, normalization, entropy, kl, *extra):
    return load_verl_config(
        None,
        [
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "agentlightning.agl_base_url=http://127.0.0.1:1",
            "agentlightning.trace_aggregator.level=trajectory",
            f"agentlightning.loss_normalization={normalization}",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}",
            f"actor_rollout_ref.actor.entropy_coeff={entropy}",
            f"actor_rollout_ref.actor.use_kl_loss={str(kl).lower()}",
            "actor_rollout_ref.actor.kl_loss_coef=0.5",
            "trainer.device=cpu",
            *extra,
        ],
    )


def torch_update(config, models, tokenizer, rollouts):
    """The torch backend's actor update on the pipeline's batch, and that batch's first mini-batch."""
    model, ref = models
    actor = config.actor_rollout_ref.actor
    optimizer = make_optimizer(model, actor.optim)
    plugins = PluginManager(load_entrypoints=False)
    loss_fn = plugins.policy_losses.get(actor.policy_loss.loss_mode)
    settings = ActorSettings.from_config(config.actor_rollout_ref)
    update = ActorUpdate(
        model,
        ref if actor.use_kl_loss else None,
        optimizer,
        loss_fn,
        settings,
        torch.device("cpu"),
        tokenizer.pad_token_id,
    )
    prepared = StepPipeline(config, plugins, tokenizer).prepare(rollouts, step=1)
    batch = update.batch(prepared)
    noise = 0.3 * torch.randn(batch.old_log_prob.shape, generator=torch.Generator().manual_seed(1))
    batch = attrs.evolve(batch, old_log_prob=batch.old_log_prob + noise * batch.mask)
    per_mini = len(prepared.shaped.rows) // prepared.shaped.n_mini_batches
    return update, prepared, batch.rows(slice(0, per_mini)), per_mini


def verl_mini_batch(prepared, mini, per_mini, tokenizer):
    """The first mini-batch as verl's trainer builds its ``DataProto`` (agl_backend_verl.trainer.learn)."""
    padded = tensorize(prepared.shaped.rows[:per_mini], pad_token_id=tokenizer.pad_token_id)
    batch = to_dataproto(padded, meta_info={"temperature": 1.0})
    batch.batch["advantages"] = mini.advantages
    batch.batch["old_log_probs"] = mini.old_log_prob
    if mini.ref_log_prob is not None:
        batch.batch["ref_log_prob"] = mini.ref_log_prob
    return batch
