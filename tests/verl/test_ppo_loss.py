"""verl 0.9.1's own actor loss, ``verl.workers.utils.losses.ppo_loss``, against the torch backend's
update on the same batch and weights: the same loss, metrics and gradients.

The batch is agl's: rollouts from the recorded gateway traces (multi-turn ones break into several
rows) through :class:`~agl_core.stages.pipeline.StepPipeline`, then the torch backend's
:meth:`~agl_core.backends.torch.update.ActorUpdate.batch` (old and reference log-probs of the tiny
Qwen2 of the fixtures; the old ones are perturbed so that ratios clip). verl's side gets the same
batch as its trainer hands it to the actor (``left_right_2_no_padding``), model outputs from
``agl_core.backends.ppo`` in its engine's layout, its ``ActorConfig`` built from agl's
verl config with ``omega_conf_to_dataclass``, and splits the mini-batch into micro-batches as its
engine does (:mod:`tests.helpers.verl_local_workers`). Tolerance: 1e-5 relative in fp32 for the loss, every
metric and the gradient (each gradient element within 1e-5 of the largest).

The ``slow`` test runs verl's FSDP2 engine itself, on two CPU ranks (:mod:`tests.helpers.verl_fsdp_cpu`), for
a whole update step: ``per_rollout_mean``'s ``× dp_size`` and ``token_mean``'s global token count
must cancel FSDP's averaging of the gradients over the ranks.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.verl

pytest.importorskip("verl")

from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.metric import Metric  # noqa: E402
from verl.utils.py_functional import rename_dict  # noqa: E402

from agl_core.serving.processes import free_port  # noqa: E402
from tests.helpers.paths import GATEWAY_TRACES  # noqa: E402
from tests.helpers.verl_local_workers import engine_mini_batch, ppo_mini_batch  # noqa: E402
from tests.helpers.verl_ppo import policy_and_reference, recorded_rollouts, torch_update, verl_config, verl_mini_batch  # noqa: E402

RTOL = 1e-5
# ppo_loss's metrics that verl's engine averages over micro-batches (the torch backend takes them over
# the mini-batch at once); the loss terms are sums over micro-batches, equal either way.
MICRO_BATCH_MEANS = {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}

# Every built-in loss, both normalisations of the per-rollout ones, each without and with the entropy
# and KL terms.
CASES = [
    pytest.param(loss, normalization, entropy, kl, id=f"{loss}-{normalization}-{'entropy-kl' if kl else 'pg-only'}")
    for loss, normalization in (
        ("per_rollout_mean", "rollouts"),
        ("per_rollout_mean", "upstream"),
        ("cispo_per_rollout_mean", "rollouts"),
        ("cispo_per_rollout_mean", "upstream"),
        ("token_mean", "rollouts"),
    )
    for entropy, kl in ((0.0, False), (0.1, True))
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def rollouts(gateway_traces):
    return recorded_rollouts(gateway_traces)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return policy_and_reference(tiny_model_dir)


def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def assert_close(got, want, what):
    assert got == pytest.approx(want, rel=RTOL, abs=1e-8), what


@pytest.mark.parametrize(("loss", "normalization", "entropy", "kl"), CASES)
def test_verls_ppo_loss_equals_the_torch_update(
    tiny_model_dir, tokenizer, rollouts, models, loss, normalization, entropy, kl
):
    config = verl_config(tiny_model_dir, loss, normalization, entropy, kl)
    update, prepared, mini, per_mini = torch_update(config, models, tokenizer, rollouts)
    assert per_mini == 4 and prepared.shaped.n_mini_batches >= 2
    assert len({row.rollout_id for row in prepared.shaped.rows}) < len(prepared.shaped.rows), (
        "some rollout has several rows"
    )

    update.model.zero_grad(set_to_none=True)
    torch_loss, torch_metrics = update.step.loss(update.stats(mini), mini, update.settings.loss)
    torch_loss.backward()
    torch_grad = flat_grad(update.model)
    assert torch_metrics["actor/pg_clipfrac"] > 0, "the perturbed old log-probs make some ratios clip"
    expected_names = {
        "actor/pg_loss",
        "actor/entropy_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
    }
    expected_names |= {"actor/kl_loss", "actor/kl_coef"} if kl else set()
    assert set(torch_metrics) == expected_names | {"actor/loss"}

    batch = verl_mini_batch(prepared, mini, per_mini, tokenizer)
    for micro in (per_mini, 2):  # the whole mini-batch at once, then two micro-batches
        config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = micro
        actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        update.model.zero_grad(set_to_none=True)
        verl_loss, merged = ppo_mini_batch(actor_config, update.model, engine_mini_batch(batch, actor_config))
        verl_metrics = {
            k: Metric.aggregate_dp([v]) if isinstance(v, Metric) else float(np.mean(v)) for k, v in merged.items()
        }
        verl_metrics = rename_dict(verl_metrics, "actor/")  # as verl's trainer names them

        assert_close(float(verl_loss), torch_loss.item(), f"loss, micro-batches of {micro}")
        assert set(verl_metrics) == expected_names
        for name in expected_names - (MICRO_BATCH_MEANS if micro < per_mini else set()):
            assert_close(verl_metrics[name], torch_metrics[name], f"{name}, micro-batches of {micro}")
        torch.testing.assert_close(
            flat_grad(update.model), torch_grad, rtol=RTOL, atol=RTOL * float(torch_grad.abs().max())
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss", "entropy", "kl"),
    [("per_rollout_mean", 0.1, False), ("token_mean", 0.0, True)],
    ids=["per_rollout_mean-entropy", "token_mean-kl"],
)
def test_verls_fsdp_engine_on_two_cpu_ranks_steps_as_the_torch_backend(tiny_model_dir, tmp_path, loss, entropy, kl):
    """verl's FSDP2 engine (tests/helpers/verl_fsdp_cpu.py: gloo, two ranks, half the mini-batch each) trains
    one mini-batch as the torch backend does in one process: the same loss, loss terms, gradient
    norm and clipped gradients (1e-5 relative), and weights after the AdamW step within 1e-6 (the
    step is about lr = 1e-3) wherever the gradient is above Adam's eps range."""
    from tests.helpers.verl_fsdp_cpu import run_rank

    case = {
        "model_dir": str(tiny_model_dir),
        "traces": str(GATEWAY_TRACES / "traces.json"),
        "loss": loss,
        "normalization": "rollouts",
        "entropy": entropy,
        "kl": kl,
        "overrides": [
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        ],
    }
    torch.multiprocessing.spawn(run_rank, args=(2, free_port(), case, str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    ours = ranks[0]["torch"]
    # verl's worker averages each rank's loss (local sum × dp_size) over the ranks: the mini-batch's loss
    assert_close(float(np.mean([r["loss"] for r in ranks])), ours["actor/loss"], "loss")
    for name in ("actor/pg_loss", "actor/entropy_loss", *(["actor/kl_loss"] if kl else [])):
        assert_close(float(np.mean([r["metrics"][name] for r in ranks])), ours[name], name)
    assert ranks[0]["grad_norm"] == ranks[1]["grad_norm"]
    assert_close(ranks[0]["grad_norm"], ours["actor/grad_norm"], "grad norm")
    assert ranks[0]["max_grad_diff"] <= RTOL * ranks[0]["max_grad"]
    assert ranks[0]["max_param_change"] > 5e-4 and ranks[0]["max_param_diff"] <= 1e-6
