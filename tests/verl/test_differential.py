"""agl's estimators and losses against real verl 0.9.1 on CPU: same inputs, same numbers.

Advantages: with one row per rollout, rollout-level ``grpo`` (with and without std scaling) and
``rloo`` equal verl's ``compute_advantage``. Losses: ``token_mean``, registered in verl's
policy-loss registry through :func:`agl_backend_verl.policy_loss.as_verl_policy_loss`, equals verl's ``vanilla``
loss with ``token-mean`` aggregation, metrics included. ``per_rollout_mean`` over normalised
advantages of single-row rollouts reduces to verl's ``vanilla`` with ``seq-mean-token-mean``
aggregation (``upstream`` mode), times the mini-batch count (``rollouts`` mode); so does
``cispo_per_rollout_mean`` to verl's own ``cispo`` loss with that aggregation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl import DataProto
from verl.trainer.ppo.core_algos import AdvantageEstimator, get_policy_loss_fn, register_policy_loss
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.workers.config import ActorConfig

from agl_backend_verl.policy_loss import as_verl_policy_loss
from agl_core.builtins.estimators import grpo, rloo
from agl_core.builtins.losses import cispo_per_rollout_mean, per_rollout_mean, token_mean
from agl_core.data import TrainingRow
from agl_core.stages.advantage import AdvantageSettings
from agl_core.stages.normalization import rollout_scales

pytestmark = pytest.mark.verl

AGL_TOKEN_MEAN = "agl_test_token_mean"
AGL_PER_ROLLOUT_MEAN = "agl_test_per_rollout_mean"
register_policy_loss(AGL_TOKEN_MEAN)(as_verl_policy_loss(token_mean))
AGL_CISPO_PER_ROLLOUT_MEAN = "agl_test_cispo_per_rollout_mean"
register_policy_loss(AGL_PER_ROLLOUT_MEAN)(as_verl_policy_loss(per_rollout_mean))
register_policy_loss(AGL_CISPO_PER_ROLLOUT_MEAN)(as_verl_policy_loss(cispo_per_rollout_mean))


@st.composite
def single_row_batches(draw):
    """Groups of 2-6 single-row rollouts; rewards from a small set (ties: zero-variance groups) or
    continuous; masks with untrained tokens inside and right padding."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = []
    for g in range(draw(st.integers(1, 5))):
        discrete = draw(st.booleans())
        for r in range(draw(st.integers(2, 6))):
            reward = float(rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0])) if discrete else float(rng.uniform(-3, 3))
            length = int(rng.integers(1, 9))
            mask = (rng.random(length) < 0.8).astype(int)
            mask[0] = 1
            rows.append(
                TrainingRow(
                    prompt_ids=[1],
                    response_ids=[2] * length,
                    response_mask=mask,
                    reward=reward,
                    rollout_id=f"g{g}r{r}",
                    group_id=f"g{g}",
                )
            )
    order = draw(st.permutations(range(len(rows))))
    return [rows[i] for i in order]


def _padded(arrays, dtype=torch.float32):
    out = torch.zeros(len(arrays), max(len(a) for a in arrays), dtype=dtype)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = torch.as_tensor(np.asarray(a), dtype=dtype)
    return out


def _verl_advantages(rows, estimator, norm):
    """verl's advantages, computed in float64 so the only rounding left is our float32 result."""
    mask = _padded([row.response_mask for row in rows], dtype=torch.float64)
    rewards = torch.zeros_like(mask)
    for i, row in enumerate(rows):
        rewards[i, len(row.response_ids) - 1] = row.reward  # the score sits on the last response token
    data = DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask},
        non_tensors={"uid": np.array([row.group_id for row in rows], dtype=object)},
    )
    out = compute_advantage(data, adv_estimator=estimator, norm_adv_by_std_in_grpo=norm, num_repeat=1)
    return out.batch["advantages"]


@settings(max_examples=40, deadline=None)
@given(rows=single_row_batches(), norm=st.booleans())
def test_grpo_equals_verl(rows, norm):
    ours = _padded(grpo(rows, AdvantageSettings(norm_adv_by_std=norm)).per_row, dtype=torch.float64)
    torch.testing.assert_close(ours, _verl_advantages(rows, AdvantageEstimator.GRPO, norm), rtol=1e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(rows=single_row_batches())
def test_rloo_equals_verl(rows):
    ours = _padded(rloo(rows, AdvantageSettings()).per_row, dtype=torch.float64)
    torch.testing.assert_close(ours, _verl_advantages(rows, AdvantageEstimator.RLOO, True), rtol=1e-6, atol=1e-6)


def _loss_inputs(seed, batch=6, length=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g) * 3
    new = old + (torch.rand(batch, length, generator=g) - 0.5) * 1.5
    adv = torch.randn(batch, length, generator=g)
    mask = torch.rand(batch, length, generator=g) > 0.25
    mask[:, 0] = True
    weights = torch.rand(batch, length, generator=g) + 0.5
    return old, new, adv, mask, weights


def _actor_config(seed, **extra):
    rng = np.random.default_rng(seed)
    return ActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        clip_ratio=float(rng.uniform(0.1, 0.3)),
        clip_ratio_low=float(rng.uniform(0.1, 0.3)),
        clip_ratio_high=float(rng.uniform(0.1, 0.4)),
        clip_ratio_c=float(rng.uniform(1.5, 4.0)),
        **extra,
    )


def _assert_same(ours, reference):
    torch.testing.assert_close(ours[0], reference[0], rtol=1e-6, atol=1e-6)
    assert ours[1].keys() == reference[1].keys()
    for key in reference[1]:
        assert ours[1][key] == pytest.approx(reference[1][key], rel=1e-6, abs=1e-6), key


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), weighted=st.booleans(), global_info=st.booleans())
def test_token_mean_equals_verl_vanilla_token_mean(seed, weighted, global_info):
    old, new, adv, mask, weights = _loss_inputs(seed)
    config = _actor_config(seed)
    if global_info:
        config.global_batch_info.update(dp_size=2, batch_num_tokens=int(mask.sum()) * 2)
    is_weights = weights if weighted else None
    ours = get_policy_loss_fn(AGL_TOKEN_MEAN)(old, new, adv, mask, "token-mean", config, is_weights)
    reference = get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", config, is_weights)
    _assert_same(ours, reference)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), weighted=st.booleans(), n_mini_batches=st.integers(1, 4))
@pytest.mark.parametrize(("ours", "verls"), [(AGL_PER_ROLLOUT_MEAN, "vanilla"), (AGL_CISPO_PER_ROLLOUT_MEAN, "cispo")])
def test_per_rollout_mean_of_single_row_rollouts_is_a_mean_over_rollouts(ours, verls, seed, weighted, n_mini_batches):
    """Closed form: with one row per rollout, normalising by ``T_r × N`` (upstream) makes the summed loss
    ``(1/N) sum_rows mean_tokens l`` — verl's vanilla loss with ``seq-mean-token-mean`` aggregation; the
    ``rollouts`` mode is the same times the mini-batch count M."""
    old, new, adv, mask, weights = _loss_inputs(seed)
    adv = adv * mask  # a rollout-level advantage lives on trained tokens only
    ids = [f"r{i}" for i in range(len(adv))]
    config = _actor_config(seed)
    is_weights = weights if weighted else None
    reference = get_policy_loss_fn(verls)(old, new, adv, mask, "seq-mean-token-mean", config, is_weights)
    for mode, factor in (("upstream", 1.0), ("rollouts", float(n_mini_batches))):
        scales = rollout_scales(ids, mask.bool().sum(dim=-1).numpy(), mode=mode, n_mini_batches=n_mini_batches)
        scaled = adv * torch.as_tensor(scales, dtype=adv.dtype)[:, None]
        loss, metrics = get_policy_loss_fn(ours)(old, new, scaled, mask, "token-mean", config, is_weights)
        _assert_same((loss / factor, metrics), reference)
