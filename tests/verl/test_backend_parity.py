"""One config through both backends: a training step and a validation pass report the same metric names.

The torch backend runs for real on the corridor's tiny policy (embedded rollouts, as
``test_torch_backend`` does), through its loop: the validation before training, then one step. The
verl side is the trainer agl runs for verl's V1 ``sync`` mode, with verl's own loop and trainer
methods, agl's ``learn`` and its embedded rollout source (the agents calling the torch backend's
serving engine, from the same initial weights), TransferQueue on a local Ray; verl's worker groups
are answered in this process (:mod:`tests.helpers.verl_local_workers`: verl's ``ppo_loss`` on the
policy; FSDP and the replicas are left out). The names only one backend can have are listed here,
each with its reason.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.ray]

pytest.importorskip("verl")

from agl_backend_verl.config import load_verl_config  # noqa: E402
from agl_backend_verl.run import rollout_source, v1_config  # noqa: E402
from agl_core.backends.loop import LoopSettings, run_steps  # noqa: E402
from agl_core.config import load_config  # noqa: E402
from agl_core.plugins import PluginManager  # noqa: E402
from tests.helpers.corridor_policy import build_corridor_policy  # noqa: E402
from tests.helpers.torch_runs import CONFIG, Running  # noqa: E402
from tests.helpers.verl_local_workers import fit_locally, local_trainer_class, transfer_queue_session  # noqa: E402

# Training-step names only verl's trainer has: its timing of the weight push, the workers' MFU and
# memory, the sequence-length balance of the batch across data-parallel ranks, and what verl's
# _compute_old_log_prob logs: the policy's entropy over the batch before the update, and its check of
# the rollout's log-probs against the actor's (rollout.calculate_log_probs).
VERL_ONLY = {
    "timing/update_weights_s",
    "perf/mfu/actor",
    "actor/perf/max_memory_allocated_gb",
    "actor/perf/max_memory_reserved_gb",
    "actor/perf/cpu_memory_used_gb",
    "actor/entropy",
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_std",
    "training/rollout_probs_diff_valid",
    "training/rollout_actor_probs_pearson_corr",
}
VERL_ONLY_PREFIXES = ("global_seqlen/",)
# Only the torch backend has: the count of its optimizer steps (verl logs none), the tokens it
# updated on, its micro-batches, their padding and prefix sharing, and the restarts of its own serving engine.
TORCH_ONLY = {
    "actor/n_updates",
    "actor/n_micro_batches",
    "perf/total_num_tokens",
    "perf/padded_per_real_tokens",
    "perf/computed_per_row_tokens",
    "training/engine/n_restarts",
}
# Validation names only the torch backend has: verl's loop does not time the validation before training.
TORCH_ONLY_VALIDATION = {"timing/val_s"}

# The terms of the actor loss, with verl's names, on both backends.
LOSS_TERMS = {
    "actor/pg_loss",
    "actor/entropy_loss",
    "actor/kl_loss",
    "actor/kl_coef",
    "actor/loss",
    "actor/grad_norm",
    "actor/lr",
}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_corridor_policy(tmp_path_factory.mktemp("policy"))


def _overrides(policy, tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"id": i, "signs": ["left", "right", "left"]}) + "\n" for i in range(3)))
    return [
        f"actor_rollout_ref.model.path={policy}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"data.val_files={val}",
        "data.val_batch_size=2",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "agentlightning.torch.num_threads=1",
    ]


def verl_step_and_validation(config, base_url):
    """One ``fit`` of the V1 trainer on local workers: the validation before training, then one step;
    the metrics of each."""
    plugins = PluginManager.from_config(config, load_entrypoints=False)
    with transfer_queue_session(config):
        trainer = local_trainer_class("sync", [base_url])(config, plugins=plugins)
        trainer.init()
        reports = fit_locally(
            trainer, rollout_source(config, plugins, trainer), int(config.actor_rollout_ref.rollout.n)
        )
    (val,) = [metrics for step, _, metrics, _ in reports if step == 0]
    (train,) = [metrics for step, _, metrics, _ in reports if step == 1]
    return train, val


def test_a_step_and_a_validation_report_the_same_names_on_both_backends(policy, tmp_path):
    overrides = _overrides(policy, tmp_path)
    running = Running(load_config(CONFIG, overrides))
    try:
        settings = LoopSettings(total_steps=1, test_freq=-1, save_freq=-1, validate_first=True)
        (_, _, torch_val), (_, _, torch_step) = run_steps(running.backend, settings)
        config = load_verl_config(
            CONFIG,
            [
                *overrides,
                "agentlightning.backend=verl",
                "trainer.device=cpu",
                "trainer.total_training_steps=1",
                "trainer.test_freq=-1",
                "trainer.save_freq=-1",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            ],
        )
        verl_step, verl_val = verl_step_and_validation(v1_config(config), running.backend.engine.base_url)
    finally:
        running.close()

    assert torch_step["training/n_skipped_updates"] == verl_step["training/n_skipped_updates"] == 0.0
    verl_names = {name for name in verl_step if not name.startswith(VERL_ONLY_PREFIXES)}
    assert verl_names - set(torch_step) == VERL_ONLY
    assert set(torch_step) - verl_names == TORCH_ONLY
    assert LOSS_TERMS <= set(torch_step) and any(name.startswith(VERL_ONLY_PREFIXES) for name in verl_step)
    assert set(torch_val) - set(verl_val) == TORCH_ONLY_VALIDATION and set(verl_val) <= set(torch_val)
    assert {
        "val/n_rollouts_w_trace",
        "val/n_rollouts_w_reward",
        "val/turn_count",
        "val/mean_response_length_per_turn",
    } <= set(verl_val)
    assert torch_val["val/n_rollouts"] == verl_val["val/n_rollouts"] == 3
    assert torch_val["val/n_batches"] == verl_val["val/n_batches"] == 2
