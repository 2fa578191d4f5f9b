"""The same recorded step, one training step on the torch backend and one through verl's V1 update
path on CPU ranks (gloo), from the same weights: the same updated weights and shared metrics.

The step is step 2 of the recorded corridor run (tests/fixtures/corridor_recording) on the
corridor's tiny policy; :mod:`tests.helpers.verl_fsdp_step` runs both sides (verl's: the rows as
agl's V1 trainer writes them to TransferQueue, each rank's share handed to verl's actor
``TrainingWorker.train_mini_batch`` with the extra info of verl's ``_update_actor``, its FSDP2
engine and ``ppo_loss``; the metrics as ``_update_actor`` reduces them). Cases: both built-in losses ×
both ``agentlightning.loss_normalization`` modes, with the entropy bonus and the KL term on, on one
and two ranks, with one micro-batch per mini-batch and with token-budget micro-batches
(``use_dynamic_bsz``), over two mini-batches (two optimizer steps); and a third-party plugin set
(``examples/retoken_merge``'s aggregator and :class:`~tests.helpers.median_baseline.MedianBaseline`,
a plugin's estimator). On two ranks the verl side's rows are put in the trainer's dispatch order first
(:mod:`agl_backend_verl.dispatch`), without which verl trains other mini-batches.

Tolerances, in fp32: the first optimizer step's clipped gradient within 1e-5 of its largest
element, every shared metric within 1e-5 relative; the second step's gradient and the weights after
the step (each tensor's, relative to its largest weight, where every step's gradient is above 1e-6:
AdamW magnifies the rounding of gradients near its eps into differences of up to ``lr``) within
5e-5. A planted backend difference (the torch side's loss given its settings without
``batch_num_tokens``) must break them.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.paths import RECORDED_CORRIDOR

pytestmark = [pytest.mark.verl, pytest.mark.slow]

RTOL = 1e-5
RECORDED_ROLLOUTS = RECORDED_CORRIDOR / "rollouts.jsonl"
STEP = 2
BUILT_IN = [
    (loss, normalization) for loss in ("per_rollout_mean", "token_mean") for normalization in ("rollouts", "upstream")
]


def case(
    case_id,
    *,
    loss="per_rollout_mean",
    normalization="rollouts",
    micro="one",
    plugins=False,
    planted=False,
    dp=1,
    dispatch="torch_mini_batches",
):
    return {
        "id": case_id,
        "dp": dp,
        "dispatch": dispatch,
        "loss": loss,
        "normalization": normalization,
        "aggregator": "retoken_merge" if plugins else "trajectory",
        "estimator": "median_baseline" if plugins else "turn_grpo",
        "plugins": plugins,
        "planted": planted,
        "mini_batch_size": 2,  # two mini-batches of 2 x rollout.n rows
        "micro_batch_size": 16 // dp,  # the whole per-rank share of a mini-batch
        "token_budget": 512 if micro == "several" else None,
    }


CASES = [
    *(case(f"{loss}-{norm}-dp1-one_micro", loss=loss, normalization=norm) for loss, norm in BUILT_IN),
    *(
        case(f"{loss}-{norm}-dp2-several_micro", loss=loss, normalization=norm, micro="several", dp=2)
        for loss, norm in BUILT_IN
    ),
    case("per_rollout_mean-rollouts-dp1-several_micro", micro="several"),
    case("token_mean-rollouts-dp2-one_micro", loss="token_mean", dp=2),
    case("plugins-retoken_merge-median_baseline-dp2-several_micro", micro="several", plugins=True, dp=2),
]
PLANTED = case(
    "planted-token_mean-no_batch_num_tokens-dp1-several_micro", loss="token_mean", micro="several", planted=True
)
VERL_DISPATCH = case(
    "per_rollout_mean-rollouts-dp2-several_micro-verl_dispatch", micro="several", dp=2, dispatch="verl"
)
CONTIGUOUS = case(
    "per_rollout_mean-rollouts-dp2-several_micro-contiguous", micro="several", dp=2, dispatch="contiguous"
)


def differences(result: dict) -> dict[str, float]:
    """The measured differences of a case, relative: the first optimizer step's gradient, the later
    steps' gradients, the weights after the step, and each shared metric."""
    from tests.helpers.verl_fsdp_step import MICRO_BATCH_MEANS

    several = result["n_micro_batches"] > 1 or result["dp_size"] > 1
    first, *later = result["rel_grad_diff_per_step"]
    out = {"grad_first_step": first, "grad_later_steps": max(later), "params": result["max_rel_param_diff"]}
    for name, want in result["torch"].items():
        if several and name in MICRO_BATCH_MEANS:
            continue
        out[name] = abs(result["verl"][name] - want) / max(abs(want), 1e-6)
    return out


def tolerance(name: str) -> float:
    """1e-5 relative, but 5e-5 for what comes after the first AdamW step: its weights differ already
    where AdamW magnifies rounding (gradients near its eps), and the later gradients start from them."""
    return 5 * RTOL if name in ("grad_later_steps", "params") else RTOL


def assert_same(result: dict) -> None:
    too_far = {k: v for k, v in differences(result).items() if not v <= tolerance(k)}
    assert not too_far, f"beyond the tolerance (1e-5 relative; 5e-5 after the first step): {too_far}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case (and the planted one) on its ranks: one spawn per data-parallel size."""
    import torch

    from agl_core.serving.processes import free_port
    from tests.helpers.corridor_policy import build_corridor_policy
    from tests.helpers.verl_fsdp_step import run_cases

    root = tmp_path_factory.mktemp("differential")
    policy = build_corridor_policy(root / "policy")
    common = {"model_dir": str(policy), "recording": str(RECORDED_ROLLOUTS), "step": STEP}
    cases = [{**c, **common} for c in (*CASES, PLANTED, VERL_DISPATCH, CONTIGUOUS)]
    for dp in (1, 2):
        torch.multiprocessing.spawn(
            run_cases, args=(dp, free_port(), [c for c in cases if c["dp"] == dp], str(root)), nprocs=dp
        )
    return {c["id"]: json.loads((root / f"{c['id']}.json").read_text()) for c in cases}


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_one_recorded_step_updates_verls_engine_as_the_torch_backend(results, case_id):
    result = results[case_id]
    assert result["n_optimizer_steps"] == result["n_mini_batches"] == 2
    assert result["max_param_change"] > 5e-4, "the step moved the weights"
    assert result["torch"]["actor/kl_loss"] > 0 and result["torch"]["actor/entropy_loss"] > 0
    if "several_micro" in case_id:
        assert result["n_micro_batches"] > 1
    assert_same(result)


def test_a_planted_backend_difference_is_caught(results):
    planted = results[PLANTED["id"]]
    assert planted["n_micro_batches"] > 1
    with pytest.raises(AssertionError, match="beyond the tolerance"):
        assert_same(planted)
    measured = differences(planted)
    assert measured["grad_first_step"] > 1e-2 and measured["params"] > 1e-2 and measured["actor/pg_loss"] > 1e-2


def test_the_trainers_dispatch_order_trains_the_torch_backends_mini_batches_on_two_ranks(results):
    """The verl trainer's row order (:func:`agl_backend_verl.dispatch.dispatch_order`, balanced within
    each mini-batch) makes verl's dispatch (a contiguous share per rank, then that share's mini-batches)
    train the torch backend's mini-batches: the same updates."""
    result = results[VERL_DISPATCH["id"]]
    print("dp=2, the trainer's dispatch order:", differences(result))
    assert result["n_optimizer_steps"] == result["n_mini_batches"] == 2
    assert_same(result)


def test_without_the_dispatch_order_verl_trains_other_mini_batches_on_two_ranks(results):
    """Why the order is needed: left as they are, the rows reach verl's ranks as contiguous shares,
    so its first mini-batch is rows 0-7 and 16-23 instead of rows 0-15, and the updates part."""
    measured = differences(results[CONTIGUOUS["id"]])
    print("dp=2, rows left as they are:", measured)
    assert measured["grad_first_step"] > 1e-2 and measured["params"] > 1e-2
