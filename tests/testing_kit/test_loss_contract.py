"""Every built-in policy loss passes the shipped contract, and the contract catches a gallery of
realistic loss bugs, each by the property named beside it."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import Phase, find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from agl_core import PluginManager, PolicyLossSpec, masked_sum, policy_loss_spec
from agl_core.builtins.losses import cispo_per_rollout_mean, per_rollout_mean, token_mean
from agl_core.testing.contracts import PolicyLossContract
from agl_core.testing.loss_contract import (
    check_clip_bounds,
    check_finite_and_padding,
    check_inputs_unchanged,
    check_micro_batches_add_up,
    check_sums_tokens,
    check_zero_advantage_zero_gradient,
)
from agl_core.testing.strategies import loss_batches, loss_settings


class TestTokenMeanContract(PolicyLossContract):
    loss_name = "token_mean"


class TestPerRolloutMeanContract(PolicyLossContract):
    loss_name = "per_rollout_mean"


def cispo_reference(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    """CISPO token by token: each trained token adds ``-w * A * log_prob``, ``w`` the ratio clipped
    to ``[1 - low, 1 + high]`` taken as a plain number (no gradient), times the importance weight;
    the sum is scaled by ``dp_size``."""
    total = log_prob.new_zeros(())
    for i, j in zip(*(index.tolist() for index in torch.nonzero(response_mask.bool(), as_tuple=True))):
        ratio = math.exp(min(max(float(log_prob[i, j].detach() - old_log_prob[i, j]), -20.0), 20.0))
        weight = min(max(ratio, 1 - settings.low), 1 + settings.high)
        term = -weight * advantages[i, j] * log_prob[i, j]
        total = total + (term if rollout_is_weights is None else term * rollout_is_weights[i, j])
    return total * settings.dp_size, {}


class TestCispoPerRolloutMeanContract(PolicyLossContract):
    loss_name = "cispo_per_rollout_mean"
    clips_ratio = False  # a clipped token keeps its gradient, weighted by the clipped ratio
    reference = cispo_reference


def test_every_built_in_loss_has_a_contract_test():
    tested = {cls.loss_name for cls in PolicyLossContract.__subclasses__() if cls.__module__ == __name__}
    assert tested == set(PluginManager(load_entrypoints=False).policy_losses.names())


# -- the gallery: realistic bugs, each caught by one named property -------------------------------


def multiplies_by_the_mask(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    ratio = torch.exp(log_prob - old_log_prob)
    per_token = torch.maximum(
        -advantages * ratio, -advantages * torch.clamp(ratio, 1 - settings.low, 1 + settings.high)
    )
    return (per_token * response_mask).sum() / settings.batch_num_tokens, {}  # NaN * 0 is NaN


def no_clip(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    mask = response_mask.bool()
    ratio = torch.exp(torch.where(mask, log_prob - old_log_prob, 0.0))
    return masked_sum(-torch.where(mask, advantages, 0.0) * ratio, mask) / settings.batch_num_tokens, {}


def no_dual_clip(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    return token_mean(old_log_prob, log_prob, advantages, response_mask, attrs.evolve(settings, clip_ratio_c=1e9))


def own_token_mean(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    return token_mean(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        attrs.evolve(settings, batch_num_tokens=None),
        rollout_is_weights,
    )


def with_a_log_prob_bonus(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    loss, metrics = token_mean(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights)
    return loss - 0.01 * masked_sum(log_prob, response_mask.bool()) / settings.batch_num_tokens, metrics


def normalises_advantages_in_place(
    old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None
):
    advantages.div_(advantages.nan_to_num().abs().max().clamp(min=1.0))
    return token_mean(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights)


def maximises(*args, **kwargs):
    loss, metrics = token_mean(*args, **kwargs)
    return -loss, metrics


GALLERY = {
    "multiplies padded NaN by the mask instead of selecting": (multiplies_by_the_mask, "finite_and_padding"),
    "plain policy gradient, no clip": (no_clip, "clip_bounds"),
    "PPO clip without the dual clip": (no_dual_clip, "clip_bounds"),
    "averages over its own tokens, ignoring batch_num_tokens": (own_token_mean, "micro_batches_add_up"),
    "declares per-rollout scaling but averages tokens too": (
        PolicyLossSpec(token_mean, scale_advantages_per_rollout=True),
        "sums_tokens",
    ),
    "adds a log-prob bonus that moves without advantage": (with_a_log_prob_bonus, "zero_advantage_zero_gradient"),
    "normalises the advantages in place": (normalises_advantages_in_place, "inputs_unchanged"),
    "maximises the objective (sign flipped)": (maximises, "clip_bounds"),
}

PROPERTIES = {
    "finite_and_padding": lambda loss, batch, s, cuts: check_finite_and_padding(loss, batch, s),
    "zero_advantage_zero_gradient": lambda loss, batch, s, cuts: check_zero_advantage_zero_gradient(loss, batch, s),
    "clip_bounds": lambda loss, batch, s, cuts: check_clip_bounds(loss, batch, s),
    "micro_batches_add_up": lambda loss, batch, s, cuts: check_micro_batches_add_up(loss, batch, s, cuts),
    "sums_tokens": lambda loss, batch, s, cuts: check_sums_tokens(loss, batch, s),
    "inputs_unchanged": lambda loss, batch, s, cuts: check_inputs_unchanged(loss, batch, s),
}


def caught(loss, prop):
    """Whether property ``prop`` fails ``loss`` on some generated case (generation only)."""

    def fails(case):
        batch, s, cuts = case
        try:
            PROPERTIES[prop](loss, batch, s, cuts)
        except AssertionError:
            return True
        return False

    cases = st.tuples(loss_batches(), loss_settings(), st.lists(st.integers(1, 5), max_size=3))
    try:
        find(cases, fails, settings=settings(max_examples=1000, database=None, phases=[Phase.generate]))
    except NoSuchExample:
        return False
    return True


@pytest.mark.parametrize("bug", sorted(GALLERY))
def test_the_contract_catches_a_planted_bug_by_its_property(bug):
    loss, prop = GALLERY[bug]
    assert caught(loss, prop), f"{bug!r} slipped past {prop}"


def test_the_built_ins_declare_their_normalisation():
    registered = PluginManager(load_entrypoints=False).policy_losses
    assert policy_loss_spec(registered.get("per_rollout_mean")) == PolicyLossSpec(
        per_rollout_mean, scale_advantages_per_rollout=True
    )
    assert policy_loss_spec(registered.get("cispo_per_rollout_mean")) == PolicyLossSpec(
        cispo_per_rollout_mean, scale_advantages_per_rollout=True
    )
    assert policy_loss_spec(registered.get("token_mean")) == PolicyLossSpec(token_mean)
