"""One config through both backends: a training step and a validation pass report the same metric names.

The torch backend runs for real on the corridor's tiny policy (embedded rollouts, as
``test_torch_backend`` does). The verl trainer runs its real step on the same rollout source and
the same initial weights, with verl's actor workers answered in this process
(:mod:`tests.helpers.verl_local_workers`: verl's own trainer code and ``ppo_loss`` run, FSDP and the vLLM
replicas are left out). The names only one backend can have are listed here, each with its reason.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.verl

pytest.importorskip("verl")

from verl.trainer.ppo.ray_trainer import Role  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402

from agl_backend_verl.config import load_verl_config  # noqa: E402
from agl_backend_verl.trainer import AglRayPPOTrainer, SampleDataset, collate_samples  # noqa: E402
from agl_backend_verl.worker_calls import VerlWorkerCalls  # noqa: E402
from agl_core.backends.torch.backend import load_policy, model_folder  # noqa: E402
from agl_core.backends.torch.update import make_optimizer  # noqa: E402
from agl_core.config import load_config  # noqa: E402
from agl_core.datasets import load_dataset  # noqa: E402
from agl_core.plugins import PluginManager  # noqa: E402
from tests.helpers.corridor_policy import build_corridor_policy  # noqa: E402
from tests.helpers.torch_runs import CONFIG, SAMPLES, Running  # noqa: E402
from tests.helpers.verl_local_workers import LocalActorGroup  # noqa: E402

# Training-step names only verl's trainer has: its timings of the worker calls, the workers' MFU
# and memory, and the sequence-length balance of the batch across data-parallel ranks.
VERL_ONLY = {
    "timing/update_weights_s",
    "perf/mfu/actor_infer",
    "perf/mfu/actor",
    "actor/perf/max_memory_allocated_gb",
    "actor/perf/max_memory_reserved_gb",
    "actor/perf/cpu_memory_used_gb",
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


class LocalWorkerCalls(VerlWorkerCalls):
    """verl's worker calls on a trainer whose actor group is local; the replicas are the torch
    backend's serving engine, so their calls are no-ops."""

    def __init__(self, trainer, base_url):
        super().__init__(trainer)
        self.base_url = base_url

    def rollout_endpoints(self):
        return [self.base_url]

    def resume_replicas(self):
        pass

    abort_replicas = sleep_replicas = load_checkpoint = save_checkpoint = resume_replicas

    def push_weights(self, version):
        pass


def verl_trainer(config, plugins, tokenizer, source, base_url):
    val_rows = load_dataset(config.data.val_files, "data.val_files")
    trainer = AglRayPPOTrainer(
        config=config,
        tokenizer=tokenizer,
        role_worker_mapping={Role.ActorRollout: object},
        resource_pool_manager=None,
        train_dataset=SampleDataset(SAMPLES, "train_dataset"),
        val_dataset=SampleDataset(val_rows, "val_dataset"),
        collate_fn=collate_samples,
        plugins=plugins,
        rollout_source=source,
    )
    folder = model_folder(config)
    model = load_policy(folder, torch.device("cpu"))
    optimizer, _ = make_optimizer(model, config.actor_rollout_ref.actor.optim, 1)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    group = LocalActorGroup(model, load_policy(folder, torch.device("cpu"), frozen=True), actor, optimizer)
    trainer.actor_rollout_wg = trainer.ref_policy_wg = group
    trainer.calls = LocalWorkerCalls(trainer, base_url)
    return trainer


def test_a_step_and_a_validation_report_the_same_names_on_both_backends(policy, tmp_path):
    overrides = _overrides(policy, tmp_path)
    running = Running(load_config(CONFIG, overrides))
    try:
        backend = running.backend
        torch_step, torch_val = backend.train_step(SAMPLES), backend.validate()
        config = load_verl_config(
            CONFIG,
            [
                *overrides,
                "agentlightning.backend=verl",
                "trainer.device=cpu",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            ],
        )
        plugins = PluginManager.from_config(config, load_entrypoints=False)
        trainer = verl_trainer(config, plugins, backend.tokenizer, backend.source, backend.engine.base_url)
        verl_step, verl_val = trainer.train_step(SAMPLES), trainer.validate()
    finally:
        running.close()

    assert torch_step["training/n_skipped_updates"] == verl_step["training/n_skipped_updates"] == 0.0
    verl_names = {name for name in verl_step if not name.startswith(VERL_ONLY_PREFIXES)}
    assert verl_names - set(torch_step) == VERL_ONLY
    assert set(torch_step) - verl_names == TORCH_ONLY
    assert LOSS_TERMS <= set(torch_step) and any(name.startswith(VERL_ONLY_PREFIXES) for name in verl_step)
    assert set(torch_val) == set(verl_val)
    assert {
        "val/n_rollouts_w_trace",
        "val/n_rollouts_w_reward",
        "val/turn_count",
        "val/mean_response_length_per_turn",
    } <= set(verl_val)
    assert torch_val["val/n_rollouts"] == verl_val["val/n_rollouts"] == 3 and torch_val["val/n_batches"] == 2
