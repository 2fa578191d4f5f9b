"""Step 2 of the corridor recording through a backend's ``update``, as the trl tests compare it.

:func:`recorded_step` builds the backend (``trl`` or the reference ``torch``) on the corridor's
policy, runs the step pipeline on the recorded rollouts and the update, and returns what the
comparisons read. Run as a module under ``torchrun`` (``python -m torch.distributed.run
--nproc-per-node N -m tests.trl.recorded_step OUT POLICY FOLDER``) it makes the trl update of every
case of :data:`DATA_PARALLEL_CASES` in N processes: the others follow process 0
(:meth:`agl_backend_trl.backend.TrlBackend.follow`), then every process ends the process group as a
run's ``fit`` does, and process 0 saves the cases' results and its gloo worker threads left after
the end to ``OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from agl_backend_trl.backend import TrlBackend
from agl_backend_trl.config import load_trl_config
from agl_core.backends.ppo import response_log_probs
from agl_core.backends.torch.backend import TorchBackend
from agl_core.config import load_config
from agl_core.files.recording import read_recording
from agl_core.plugins import PluginManager
from agl_core.stages.tensorize import tensorize
from tests.helpers.paths import RECORDED_CORRIDOR
from tests.trl.conftest import CONFIG, corridor_overrides

STEP = 2
TWO_MINI_BATCHES = ("actor_rollout_ref.actor.ppo_mini_batch_size=2",)
MICRO_BATCHES_OF_3 = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"
KL_ENTROPY_EPOCHS = (
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.1",
)
DATA_PARALLEL_CASES = {
    "token_mean-2_mini_batches-micro_batches_of_3": ("token_mean", (*TWO_MINI_BATCHES, MICRO_BATCHES_OF_3)),
    "per_rollout_mean-2_mini_batches-2_epochs-kl-entropy-token_budget": (
        "per_rollout_mean",
        (
            *TWO_MINI_BATCHES,
            *KL_ENTROPY_EPOCHS,
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512",
        ),
    ),
    "per_rollout_mean-lora-bf16_autocast": (
        "per_rollout_mean",
        (
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        ),
    ),
}
"""The cases the data-parallel test trains in one process and in two: ``(loss_mode, overrides)``."""


def build_backend(kind: str, loss: str, policy, folder, extra=()):
    """Backend ``kind`` on the corridor config with ``loss``, writing under ``folder``."""
    overrides = [
        *corridor_overrides(policy, folder, *extra),
        f"agentlightning.backend={kind}",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}",
        "trainer.total_training_steps=3",
    ]
    config = load_trl_config(CONFIG, overrides) if kind == "trl" else load_config(CONFIG, overrides)
    plugins = PluginManager.from_config(config, (), load_entrypoints=False)
    return (TrlBackend if kind == "trl" else TorchBackend)(config, plugins)


def recorded_step(backend, compute_dtype: torch.dtype | None = None) -> dict:
    """The recorded step's update on ``backend``: the old log-probs of its rows, the update's metrics,
    the log-probs after it, the trained weights and the number of mini-batches. ``compute_dtype``:
    the log-probs are measured under autocast to it, as a mixed-precision update computes them."""
    rollouts = read_recording(RECORDED_CORRIDOR).rollouts(STEP)
    backend.step = STEP
    prepared = backend.pipeline.prepare(rollouts, STEP)
    rows = tensorize(prepared.shaped.rows, pad_token_id=backend.pad_token_id).tensors
    measure = torch.autocast("cpu", dtype=compute_dtype, enabled=compute_dtype is not None)
    with torch.no_grad(), measure:
        old = response_log_probs(backend.model.eval(), rows)
    metrics = backend.update(prepared)
    with torch.no_grad(), measure:
        after = response_log_probs(backend.model.eval(), rows)
    weights = {n: p.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad}
    n_mini = prepared.shaped.n_mini_batches
    return {"old": old, "after": after, "metrics": metrics, "weights": weights, "n_mini": n_mini}


def gloo_worker_threads() -> int:
    """This process's threads that run gloo's collectives (Linux: named in ``/proc``)."""
    return sum((task / "comm").read_text().strip() == "pt_gloo_runloop" for task in Path("/proc/self/task").iterdir())


def main(out: str, policy: str, folder: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for case, (loss, extra) in DATA_PARALLEL_CASES.items():
        backend = build_backend("trl", loss, policy, Path(folder) / case, (*extra, "trl.use_cpu=true"))
        try:
            if backend.rank > 0:
                backend.follow()  # until process 0 closes
            else:
                results[case] = {**recorded_step(backend), "world": backend.world}
        finally:
            backend.close()
    backend.trainer.accelerator.end_training()  # what fit does after a run
    if results:
        torch.save({"cases": results, "gloo_worker_threads_after_end": gloo_worker_threads()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
