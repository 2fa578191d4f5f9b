"""Policy losses: the dual-clip PPO term, the two reductions, settings, masking and gradients."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_backend_verl.policy_loss import as_verl_policy_loss
from agl_core.builtins.losses import cispo_per_rollout_mean, per_rollout_mean, token_mean
from agl_core.config import default_config
from agl_core.plugins import PluginManager
from agl_core.stages.policy_loss import LossSettings, cispo_token_losses, ppo_token_losses

# The PPO-clipped losses; CISPO's stop-gradient weight is invisible to finite differences (gradcheck).
PPO_LOSSES = {"per_rollout_mean": per_rollout_mean, "token_mean": token_mean}
LOSSES = {**PPO_LOSSES, "cispo_per_rollout_mean": cispo_per_rollout_mean}


def _batch(seed, dtype=torch.float32, batch=3, length=5, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g, dtype=dtype) * 2
    new = old + (torch.rand(batch, length, generator=g, dtype=dtype) - 0.5) * 2 * spread
    adv = torch.randn(batch, length, generator=g, dtype=dtype)
    mask = torch.rand(batch, length, generator=g) > 0.3
    mask[:, 0] = True
    return old, new, adv, mask


def test_per_token_term_by_hand():
    s = LossSettings(clip_ratio=0.2, clip_ratio_c=3.0)
    ratio = torch.tensor([[1.5, 0.5, 1.1, 5.0, 1.5]])
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.0, -1.0]])
    old = torch.zeros_like(ratio) - 1.0
    losses, metrics = ppo_token_losses(old, old + ratio.log(), adv, torch.ones_like(ratio, dtype=torch.bool), s)
    expected = [
        -1.0 * 1.2,  # A > 0, ratio above 1 + eps: clipped
        -1.0 * 0.5,  # A > 0, ratio below 1 - eps: the unclipped term is larger
        2.0 * 1.1,  # A < 0 inside the clip range
        3.0,  # A < 0, ratio 5 > clip_ratio_c: dual clip caps -A * r at -A * c
        1.5,  # A < 0, ratio 1.5 above 1 + eps: unclipped -A * r wins
    ]
    torch.testing.assert_close(losses[0], torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 5)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)
    assert metrics["actor/ppo_kl"] == pytest.approx(-float(ratio.log().mean()), rel=1e-5)


def test_cispo_per_token_term_by_hand():
    s = LossSettings(clip_ratio=0.2, clip_ratio_high=0.3, clip_ratio_c=1.5)
    ratio = torch.tensor([[1.5, 0.5, 1.1, 5.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0]], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    new = (old + ratio.log()).requires_grad_(True)
    mask = torch.ones_like(ratio, dtype=torch.bool)
    weight = torch.tensor([[1.3, 0.8, 1.1, 1.3]], dtype=torch.float64)  # clip(r, 0.8, 1.3); no dual clip
    losses, metrics = cispo_token_losses(old, new, adv, mask, s)
    torch.testing.assert_close(losses, -weight * adv * new.detach())
    loss, _ = cispo_per_rollout_mean(old, new, adv, mask, attrs.evolve(s, dp_size=2))
    loss.backward()
    # Every token keeps a gradient, clipped ones too, of the clipped ratio's size.
    torch.testing.assert_close(new.grad, -weight * adv * 2)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(3 / 4)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(-float(ratio.log().mean()))


def test_asymmetric_clip_bounds_default_to_clip_ratio():
    assert (LossSettings(clip_ratio=0.3).low, LossSettings(clip_ratio=0.3).high) == (0.3, 0.3)
    s = LossSettings(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.4)
    old = torch.zeros(1, 2)
    new = torch.tensor([[1.3, 0.8]]).log()
    losses, _ = ppo_token_losses(old, new, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool), s)
    torch.testing.assert_close(losses, torch.tensor([[-1.3, 0.9]]))


def test_reductions():
    old, new, adv, mask = _batch(0)
    s = LossSettings()
    losses, _ = ppo_token_losses(old, new, adv, mask, s)
    total = losses[mask].sum()
    torch.testing.assert_close(per_rollout_mean(old, new, adv, mask, s)[0], total)
    torch.testing.assert_close(token_mean(old, new, adv, mask, s)[0], total / mask.sum())
    global_info = LossSettings(dp_size=4, batch_num_tokens=40)
    torch.testing.assert_close(token_mean(old, new, adv, mask, global_info)[0], total / 40 * 4)
    torch.testing.assert_close(per_rollout_mean(old, new, adv, mask, global_info)[0], total * 4)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        token_mean(old, new, adv, mask, LossSettings(dp_size=2))


def test_importance_weights_scale_each_token():
    old, new, adv, mask = _batch(1)
    weights = torch.rand(old.shape, generator=torch.Generator().manual_seed(5))
    s = LossSettings()
    plain, _ = ppo_token_losses(old, new, adv, mask, s)
    weighted, _ = ppo_token_losses(old, new, adv, mask, s, rollout_is_weights=weights)
    torch.testing.assert_close(weighted, plain * weights)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_padding_leaks_neither_value_nor_gradient(name):
    old, new, adv, mask = _batch(2)
    new = new.clone().requires_grad_(True)
    poisoned_new = torch.where(mask, new, torch.nan)
    poisoned_adv = torch.where(mask, adv, torch.nan)
    poisoned_old = torch.where(mask, old, torch.inf)
    loss, metrics = LOSSES[name](poisoned_old, poisoned_new, poisoned_adv, mask, LossSettings())
    clean, clean_metrics = LOSSES[name](old, new, adv, mask, LossSettings())
    torch.testing.assert_close(loss, clean)
    assert metrics == pytest.approx(clean_metrics)
    loss.backward()
    assert torch.isfinite(new.grad).all() and not new.grad[~mask].any()


def _away_from_kinks(old, new, adv, s):
    """True when no ratio sits within 1e-3 of a clip bound (gradcheck's finite differences straddle kinks)."""
    ratio = (new - old).exp()
    bounds = [1 - s.low, 1 + s.high]
    near = [(ratio - b).abs() < 1e-3 for b in bounds]
    dual = (ratio - s.clip_ratio_c).abs() < 1e-3
    return not any(n.any() for n in near) and not dual.any()


@pytest.mark.parametrize("name", sorted(PPO_LOSSES))
@pytest.mark.parametrize("with_weights", [False, True])
def test_gradcheck_float64(name, with_weights):
    s = LossSettings(clip_ratio=0.2, clip_ratio_c=2.0)
    checked = 0
    for seed in range(20):
        old, new, adv, mask = _batch(seed, dtype=torch.float64, spread=1.2)
        if not _away_from_kinks(old, new, adv, s):
            continue
        weights = (
            torch.rand(old.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
            if with_weights
            else None
        )
        new = new.clone().requires_grad_(True)
        adv = adv.clone().requires_grad_(True)

        def loss(n, a, old=old, mask=mask, weights=weights):
            return LOSSES[name](old, n, a, mask, s, rollout_is_weights=weights)[0]

        assert torch.autograd.gradcheck(loss, (new, adv))
        checked += 1
    assert checked >= 5


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(1e-3, 1e3))
def test_per_rollout_mean_is_linear_in_a_positive_advantage_scale(seed, scale):
    # What lets the per-rollout normalisation live in the advantages: clipping decisions do not
    # change when advantages are scaled by a positive number, and the loss scales with them.
    old, new, adv, mask = _batch(seed, dtype=torch.float64)
    s = LossSettings()
    loss, metrics = per_rollout_mean(old, new, adv, mask, s)
    scaled, scaled_metrics = per_rollout_mean(old, new, adv * scale, mask, s)
    torch.testing.assert_close(scaled, loss * scale)
    assert scaled_metrics == metrics


def test_settings_from_the_actor_config():
    actor = default_config().actor_rollout_ref.actor
    assert LossSettings.from_actor_config(actor) == LossSettings(clip_ratio=0.2, clip_ratio_c=3.0)


def test_verl_adapter_reads_global_batch_info_and_ignores_the_aggregation_mode():
    old, new, adv, mask = _batch(3)
    actor = default_config().actor_rollout_ref.actor
    config = SimpleNamespace(
        clip_ratio=0.2,
        clip_ratio_low=None,
        clip_ratio_high=0.3,
        clip_ratio_c=3.0,
        global_batch_info={"dp_size": 2, "batch_num_tokens": 30},
    )
    ours = as_verl_policy_loss(token_mean)(old, new, adv, mask, "seq-mean-token-sum", config)
    direct = token_mean(old, new, adv, mask, LossSettings(clip_ratio_high=0.3, dp_size=2, batch_num_tokens=30))
    torch.testing.assert_close(ours[0], direct[0])
    with pytest.raises(ValueError, match="needs the actor config"):
        as_verl_policy_loss(per_rollout_mean)(old, new, adv, mask)
    assert as_verl_policy_loss(per_rollout_mean)(old, new, adv, mask, config=actor)[0].shape == ()


def test_builtins_are_registered_by_the_default_plugins():
    names = PluginManager(load_entrypoints=False).policy_losses.names()
    assert {"cispo_per_rollout_mean", "per_rollout_mean", "token_mean"} <= set(names)
