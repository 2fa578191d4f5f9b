"""One recorded corridor step trained on ``trl`` equals the torch backend's update of it.

Step 2 of tests/fixtures/corridor_recording goes through the same step pipeline into each backend's
``update`` from the same weights, in one process, fp32. Compared: the old log-probs each computes
(max abs difference ≤ 1e-6); the update's loss terms and gradient norm (means over its optimizer
steps: relative ≤ 1e-5, or absolute ≤ 1e-6 for a term near 0, as in the backend contract); the
updated policy's log-probs of the same rows (max abs ≤ 1e-4, the contract's served tolerance). The
weights' largest difference is reported, not bounded: AdamW moves a weight by about ``lr`` (1e-3)
whatever its gradient, so where a gradient is near AdamW's eps its float rounding becomes a
difference of up to ``lr`` in that weight (tests/helpers/step_comparison.py says the same).

Cases: ``token_mean`` (verl's vanilla token-mean PPO loss) over 2 mini-batches; ``per_rollout_mean``
over 2 mini-batches × 2 PPO epochs with the entropy bonus and the KL term (TRL's reference model);
``per_rollout_mean`` with LoRA (TRL's ``peft_config``), and continuing a saved adapter
(``lora_adapter_path``, random weights) over 2 PPO epochs with the entropy bonus and the KL term (the
reference: the base model); the same 2 × 2 with entropy and KL, forward passes in bf16 (TRL's
``bf16``, accelerate's autocast, against the torch backend's autocast; both on padded rows, the
log-probs measured in bf16: bit for bit); the same 2 × 2 with entropy and KL in token-budget
micro-batches (``use_dynamic_bsz``; the old log-probs under their own budget; both on padded
rows); ``per_rollout_mean`` over 2 mini-batches in micro-batches of 3 rows (gradients accumulated
over TRL's ``training_step`` calls). A planted difference (trl on ``token_mean`` against torch on
``per_rollout_mean``) is beyond the tolerances.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.torch_runs import randomise_adapter
from tests.trl.recorded_step import (
    KL_ENTROPY_EPOCHS,
    MICRO_BATCHES_OF_3,
    TWO_MINI_BATCHES,
    build_backend,
    recorded_step,
)

LOG_PROB_ATOL, METRIC_RTOL, METRIC_ATOL, AFTER_ATOL = 1e-6, 1e-5, 1e-6, 1e-4
METRICS = ("actor/pg_loss", "actor/entropy_loss", "actor/loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl")
# Token budgets (padded elements; at least the config's longest row, 512) over the recorded step's rows
# (61 tokens at most, about 92 padded in a micro-batch): an update micro-batch takes about five rows,
# an old log-prob pass about eleven.
BUDGETS = {"budget": 512, "log_prob_budget": 1024}
BF16 = "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"
LORA = ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")
CASES = {
    "token_mean-2_mini_batches": ("token_mean", "token_mean", TWO_MINI_BATCHES),
    "per_rollout_mean-2_mini_batches-2_epochs-kl-entropy": (
        "per_rollout_mean",
        "per_rollout_mean",
        (*TWO_MINI_BATCHES, *KL_ENTROPY_EPOCHS),
    ),
    "per_rollout_mean-lora": (
        "per_rollout_mean",
        "per_rollout_mean",
        LORA,
    ),
    "per_rollout_mean-lora_adapter_path-2_epochs-kl-entropy": (
        "per_rollout_mean",
        "per_rollout_mean",
        (*LORA, "actor_rollout_ref.model.lora_adapter_path={adapter}", *KL_ENTROPY_EPOCHS),
    ),
    "per_rollout_mean-2_mini_batches-micro_batches_of_3": (
        "per_rollout_mean",
        "per_rollout_mean",
        (*TWO_MINI_BATCHES, MICRO_BATCHES_OF_3),
    ),
    "per_rollout_mean-2_mini_batches-2_epochs-kl-entropy-bf16_autocast": (
        "per_rollout_mean",
        "per_rollout_mean",
        (
            *TWO_MINI_BATCHES,
            *KL_ENTROPY_EPOCHS,
            BF16,
            "agentlightning.torch.share_prefixes=false",  # bf16 rounds a packed pass otherwise than a padded one
        ),
    ),
    "per_rollout_mean-2_mini_batches-2_epochs-kl-entropy-token_budget": (
        "per_rollout_mean",
        "per_rollout_mean",
        (
            *TWO_MINI_BATCHES,
            *KL_ENTROPY_EPOCHS,
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={log_prob_budget}",
            "agentlightning.torch.share_prefixes=false",
        ),
    ),
    "planted-token_mean_vs_per_rollout_mean": ("token_mean", "per_rollout_mean", TWO_MINI_BATCHES),
}


def _compare(trl_loss, torch_loss, extra, policy, folder):
    dtype = torch.bfloat16 if BF16 in extra else None
    trl_backend = build_backend("trl", trl_loss, policy, folder / "trl", (*extra, "trl.use_cpu=true"))
    trl = recorded_step(trl_backend, dtype)
    ref = recorded_step(build_backend("torch", torch_loss, policy, folder / "torch", extra), dtype)
    out = {
        "log_prob": float((trl["old"] - ref["old"]).abs().max()),
        "log_prob_after": float((trl["after"] - ref["after"]).abs().max()),
    }
    for name in METRICS:
        want = ref["metrics"][name]
        out[name] = abs(trl["metrics"][name] - want) / max(abs(want), METRIC_ATOL / METRIC_RTOL)
    out["weights"] = max(float((trl["weights"][k] - ref["weights"][k]).abs().max()) for k in ref["weights"])
    out["n_updates"] = (trl["metrics"]["actor/n_updates"], ref["metrics"]["actor/n_updates"], trl["n_mini"])
    out["trl_metrics_kept"] = sum(len(values) for values in trl_backend.trainer._metrics["train"].values())
    out["n_micro_batches"] = (trl["metrics"]["actor/n_micro_batches"], ref["metrics"]["actor/n_micro_batches"])
    return out


def saved_adapter(policy, folder):
    """A LoRA adapter (rank 4, alpha 8) of ``policy`` with random weights, saved in ``folder``."""
    from omegaconf import OmegaConf

    from agl_core import load_policy_model
    from agl_core.backends.lora import with_lora

    keys = {"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear", "exclude_modules": None}
    model = with_lora(load_policy_model(str(policy)), OmegaConf.create({**keys, "lora_adapter_path": None}))
    randomise_adapter(model)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def differences(corridor_policy, tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("trl-differential")
    adapter = saved_adapter(corridor_policy, root / "adapter")
    return {
        case: _compare(
            trl_loss, torch_loss, [e.format(adapter=adapter, **BUDGETS) for e in extra], corridor_policy, root / case
        )
        for case, (trl_loss, torch_loss, extra) in CASES.items()
    }


def beyond(measured):
    too_far = {k: v for k, v in measured.items() if k in METRICS and not v <= METRIC_RTOL}
    if not measured["log_prob"] <= LOG_PROB_ATOL:
        too_far["log_prob"] = measured["log_prob"]
    if not measured["log_prob_after"] <= AFTER_ATOL:
        too_far["log_prob_after"] = measured["log_prob_after"]
    return too_far


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("planted")])
def test_one_recorded_step_on_trl_equals_the_torch_backends(differences, case):
    measured = differences[case]
    print(case, measured)
    trl_updates, torch_updates, n_mini = measured["n_updates"]
    assert trl_updates == torch_updates == n_mini * (2 if "2_epochs" in case else 1)
    assert measured["trl_metrics_kept"] == 0, "TRL's own metrics do not pile up step after step"
    trl_passes, torch_passes = measured["n_micro_batches"]
    assert trl_passes == torch_passes >= trl_updates * (3 if "micro_batches" in case else 1)
    assert beyond(measured) == {}, f"{case}: beyond the tolerances: {beyond(measured)}"


def test_a_planted_loss_difference_is_caught(differences):
    measured = differences["planted-token_mean_vs_per_rollout_mean"]
    assert {"actor/pg_loss", "log_prob_after"} <= set(beyond(measured)), measured
