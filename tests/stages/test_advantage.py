"""Advantage estimators: rollout-level broadcast, invariances, validation, and the turn-aware estimator."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from agl_core.builtins.estimators import grpo, reinforce, reinforce_baseline, rloo, turn_grpo
from agl_core.config import ConfigError, default_config
from agl_core.data import DataValidationError, TrainingRow
from agl_core.plugins import PluginManager
from agl_core.stages.advantage import AdvantageError, AdvantageSettings, RolloutAdvantageError

BASELINED = {"grpo": grpo, "rloo": rloo, "reinforce_baseline": reinforce_baseline}
ROLLOUT_LEVEL = {**BASELINED, "reinforce": reinforce}


def make_row(rollout_id, group_id, reward, mask, *, turns=None, turn_rewards=(), turn_index=0, dropped=False):
    return TrainingRow(
        prompt_ids=[1, 2],
        response_ids=list(range(3, 3 + len(mask))),
        response_mask=mask,
        reward=reward,
        rollout_id=rollout_id,
        group_id=group_id,
        response_turns=turns,
        turn_rewards=turn_rewards,
        turn_index=turn_index,
        dropped=dropped,
    )


rewards_st = st.sampled_from([0.0, 1.0, -1.0, 0.5, 2.0]) | st.floats(-10, 10, allow_nan=False)


@st.composite
def batches(draw, min_group=2):
    """Rows of several groups; each rollout has 1-3 rows with random masks (some untrained tokens)."""
    rows = []
    for g in range(draw(st.integers(1, 4))):
        for r in range(draw(st.integers(min_group, 5))):
            reward = draw(rewards_st)
            for _ in range(draw(st.integers(1, 3))):
                mask = draw(st.lists(st.integers(0, 1), min_size=1, max_size=8))
                rows.append(make_row(f"g{g}r{r}", f"g{g}", reward, mask))
    order = draw(st.permutations(range(len(rows))))
    return [rows[i] for i in order]


@settings(max_examples=60, deadline=None)
@given(rows=batches(), name=st.sampled_from(sorted(ROLLOUT_LEVEL)), norm=st.booleans())
def test_rollout_level_advantage_is_broadcast_over_trained_tokens(rows, name, norm):
    result = ROLLOUT_LEVEL[name](rows, AdvantageSettings(norm_adv_by_std=norm))
    assert len(result.per_row) == len(rows)
    by_rollout: dict[str, set[float]] = {}
    for row, adv in zip(rows, result.per_row):
        assert adv.dtype == np.float32 and adv.shape == row.response_mask.shape
        assert not adv.flags.writeable
        assert np.all(adv[row.response_mask == 0] == 0)
        by_rollout.setdefault(row.rollout_id, set()).update(adv[row.response_mask == 1].tolist())
    assert all(len(values) <= 1 for values in by_rollout.values())
    n_rollouts = len({row.rollout_id for row in rows})
    assert result.metrics["training/rollout_level_advantage/n_rollouts"] == n_rollouts
    assert result.metrics["training/rollout_level_advantage/n_rows"] == len(rows)


def _rollout_values(rows, result):
    return {
        row.rollout_id: float(adv[row.response_mask == 1][0])
        for row, adv in zip(rows, result.per_row)
        if row.n_trained_tokens
    }


def _shifted(rows, group_id, shift):
    return [
        make_row(r.rollout_id, r.group_id, r.reward + (shift if r.group_id == group_id else 0.0), r.response_mask)
        for r in rows
    ]


@settings(max_examples=60, deadline=None)
@given(
    rows=batches(), shift=st.floats(-5, 5, allow_nan=False), norm=st.booleans(), name=st.sampled_from(["grpo", "rloo"])
)
def test_adding_a_constant_to_a_group_does_not_change_its_advantages(rows, shift, norm, name):
    estimator = BASELINED[name]
    s = AdvantageSettings(norm_adv_by_std=norm)
    before = _rollout_values(rows, estimator(rows, s))
    after = _rollout_values(rows, estimator(_shifted(rows, rows[0].group_id, shift), s))
    assert before.keys() == after.keys()
    for rid in before:
        assert after[rid] == pytest.approx(before[rid], rel=1e-4, abs=1e-4)


@settings(max_examples=40, deadline=None)
@given(rows=batches(), reward=rewards_st, name=st.sampled_from(sorted(BASELINED)), norm=st.booleans())
def test_zero_variance_groups_get_exactly_zero_advantage(rows, reward, name, norm):
    flat_group = rows[0].group_id
    rows = [
        make_row(r.rollout_id, r.group_id, reward if r.group_id == flat_group else r.reward, r.response_mask)
        for r in rows
    ]
    result = BASELINED[name](rows, AdvantageSettings(norm_adv_by_std=norm))
    for row, adv in zip(rows, result.per_row):
        if row.group_id == flat_group:
            assert not adv.any()


def test_known_values():
    rows = [make_row("a", "g", 1.0, [1, 0, 1]), make_row("b", "g", 0.0, [1]), make_row("c", "g", 0.0, [1, 1])]
    s = AdvantageSettings()
    std = np.std([1.0, 0.0, 0.0], ddof=1)
    assert _rollout_values(rows, grpo(rows, s))["a"] == pytest.approx((1 - 1 / 3) / (std + 1e-6), rel=1e-6)
    assert _rollout_values(rows, grpo(rows, AdvantageSettings(norm_adv_by_std=False)))["b"] == pytest.approx(-1 / 3)
    assert _rollout_values(rows, rloo(rows, s)) == pytest.approx({"a": 1.0, "b": -0.5, "c": -0.5})
    assert _rollout_values(rows, reinforce(rows, s)) == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert _rollout_values(rows, reinforce_baseline(rows, s)) == pytest.approx({"a": 2 / 3, "b": -1 / 3, "c": -1 / 3})


def test_a_multi_row_rollout_gets_one_advantage_and_is_counted():
    rows = [make_row("a", "g", 1.0, [1, 1]), make_row("b", "g", 0.0, [1]), make_row("a", "g", 1.0, [0, 1, 1])]
    result = grpo(rows, AdvantageSettings())
    assert result.per_row[0][0] == result.per_row[2][1] > 0
    assert result.metrics["training/rollout_level_advantage/n_multi_row_rollouts"] == 1
    assert result.metrics["training/rollout_level_advantage/max_rows_per_rollout"] == 2


def test_rows_of_one_rollout_must_agree_on_group_and_reward():
    s = AdvantageSettings()
    with pytest.raises(DataValidationError) as err:
        grpo([make_row("a", "g", 1.0, [1]), make_row("b", "g", 0.0, [1]), make_row("a", "h", 1.0, [1])], s)
    assert err.value.rollout_id == "a" and err.value.field == "rows[2].group_id" and "'g'" in str(err.value)
    with pytest.raises(DataValidationError) as err:
        rloo([make_row("a", "g", 1.0, [1]), make_row("b", "g", 0.0, [1]), make_row("a", "g", 0.5, [1])], s)
    assert err.value.rollout_id == "a" and err.value.field == "rows[2].reward"


def test_rollout_level_input_errors_stay_catchable_as_runtime_errors():
    """Agent Lightning v1.0 raised RuntimeError for rows of one rollout that disagree; so does agl,
    with its precise message, also when the error is seen from an enclosing object."""
    rows = [make_row("a", "g", 1.0, [1]), make_row("b", "g", 0.0, [1]), make_row("a", "g", 0.5, [1])]
    with pytest.raises(
        RuntimeError, match=r"rollout 'a': rows\[2\]\.reward: rows of one rollout disagree on reward"
    ) as err:
        grpo(rows, AdvantageSettings())
    assert isinstance(err.value, RolloutAdvantageError)
    wrapped = err.value.within("batch")
    assert isinstance(wrapped, RuntimeError) and wrapped.field == "batch.rows[2].reward" and wrapped.rollout_id == "a"


def test_a_non_finite_reward_is_refused_naming_the_rollout():
    good = make_row("b", "g", 0.0, [1])
    bad = SimpleNamespace(
        **{**{k: getattr(good, k) for k in ("response_mask", "group_id")}, "rollout_id": "a", "reward": math.nan}
    )
    with pytest.raises(DataValidationError) as err:
        grpo([good, bad], AdvantageSettings())
    assert err.value.rollout_id == "a" and err.value.field == "rows[1].reward"


@pytest.mark.parametrize("name", sorted(BASELINED) + ["turn_grpo"])
def test_a_group_too_small_for_the_estimator_is_named(name):
    rows = [
        make_row("a", "g", 1.0, [1], turns=[0]),
        make_row("b", "g", 0.0, [1], turns=[0]),
        make_row("c", "lonely", 1.0, [1], turns=[0]),
    ]
    estimator = {**BASELINED, "turn_grpo": turn_grpo}[name]
    with pytest.raises(AdvantageError, match="group 'lonely' has 1 rollout"):
        estimator(rows, AdvantageSettings())
    assert reinforce(rows, AdvantageSettings()).per_row[2][0] == 1.0


def test_settings_come_from_the_config_and_bad_values_name_the_key():
    cfg = default_config()
    cfg.algorithm.norm_adv_by_std_in_grpo = False
    cfg.algorithm.gamma = 0.9
    assert AdvantageSettings.from_config(cfg) == AdvantageSettings(norm_adv_by_std=False, gamma=0.9)
    cfg.algorithm.gamma = 1.5
    with pytest.raises(ConfigError, match="algorithm.gamma"):
        AdvantageSettings.from_config(cfg)
    bad = OmegaConf.create({"algorithm": {"norm_adv_by_std_in_grpo": "yes"}})
    with pytest.raises(ConfigError, match="algorithm.norm_adv_by_std_in_grpo"):
        AdvantageSettings.from_config(bad)


def test_builtins_are_registered_by_the_default_plugins():
    names = PluginManager(load_entrypoints=False).advantage_estimators.names()
    assert {"grpo", "rloo", "reinforce", "reinforce_baseline", "turn_grpo"} <= set(names)


# -- turn-aware estimator -------------------------------------------------------------------------


def _trajectory_rows(gamma_case_rewards=None):
    """Group of two rollouts. 'a' merges calls 0 and 1 into one row (observation tokens between them
    are untrained) and calls 2 into a second row; 'b' is one call."""
    tr_a = gamma_case_rewards or (None, None, None)
    a1 = make_row("a", "g", 1.0, [1, 1, 0, 0, 1], turns=[0, 0, 1, 1, 1], turn_rewards=tr_a[:2], turn_index=0)
    a2 = make_row("a", "g", 1.0, [1, 1], turns=[2, 2], turn_rewards=tr_a[2:], turn_index=2)
    b = make_row("b", "g", 0.0, [1, 1, 1], turns=[0, 0, 0], turn_rewards=(None,))
    return [a1, a2, b]


@pytest.mark.parametrize("turn_rewards", [None, (None, None, 1.0), (0.0, 0.0, 1.0)])
def test_turn_grpo_equals_rollout_level_grpo_when_all_credit_sits_on_the_last_call(turn_rewards):
    # No per-call reward (the final reward goes on the last call), or the reward given on the last
    # call itself: with gamma = 1 every call's reward-to-go is the rollout's reward.
    rows = _trajectory_rows(turn_rewards)
    for norm in (True, False):
        s = AdvantageSettings(norm_adv_by_std=norm, gamma=1.0)
        for ours, reference in zip(turn_grpo(rows, s).per_row, grpo(rows, s).per_row):
            np.testing.assert_allclose(ours, reference, rtol=1e-6)


def test_turn_grpo_differs_from_the_broadcast_exactly_on_the_calls_whose_reward_to_go_differs():
    # Rollout 'a' earned 1.0 on call 1 and nothing after it; 'b' earned nothing.
    rows = _trajectory_rows((0.0, 1.0, 0.0))
    gamma = 0.5
    result = turn_grpo(rows, AdvantageSettings(norm_adv_by_std=False, gamma=gamma))
    g_a = np.array([gamma * 1.0, 1.0, 0.0])  # reward-to-go of calls 0, 1, 2
    g_b = np.array([0.0])
    mu = (g_a.mean() + g_b.mean()) / 2
    a1, a2, b = result.per_row
    np.testing.assert_allclose(a1, [g_a[0] - mu, g_a[0] - mu, 0, 0, g_a[1] - mu], rtol=1e-6)
    np.testing.assert_allclose(a2, [g_a[2] - mu, g_a[2] - mu], rtol=1e-6)
    np.testing.assert_allclose(b, [-mu] * 3, rtol=1e-6)
    broadcast = grpo(rows, AdvantageSettings(norm_adv_by_std=False)).per_row
    differs = [~np.isclose(ours, ref) for ours, ref in zip(result.per_row, broadcast)]
    # Every trained token differs here (each call's credit moved); untrained tokens stay 0 in both.
    assert differs[0].tolist() == [True, True, False, False, True]
    # Within rollout 'a' the calls are now told apart: call 1 (the rewarded one) ranks highest.
    assert a1[4] > a1[0] > a2[0]


def test_turn_grpo_with_std_normalisation_matches_its_documented_formula():
    rows = _trajectory_rows((0.0, 1.0, 0.0))
    gamma, eps = 0.9, 1e-6
    g = {"a": np.array([gamma, 1.0, 0.0]), "b": np.array([0.0])}
    mu = np.mean([v.mean() for v in g.values()])
    sigma = math.sqrt(sum(((v - mu) ** 2).mean() for v in g.values()) / (2 - 1))
    a1, a2, b = turn_grpo(rows, AdvantageSettings(gamma=gamma)).per_row
    np.testing.assert_allclose(a1[[0, 4]], (g["a"][:2] - mu) / (sigma + eps), rtol=1e-5)
    np.testing.assert_allclose(a2, (g["a"][2] - mu) / (sigma + eps), rtol=1e-5)
    np.testing.assert_allclose(b, (0.0 - mu) / (sigma + eps), rtol=1e-5)


def test_turn_grpo_validation_names_rollout_and_field():
    rows = _trajectory_rows()
    no_turns = make_row("b", "g", 0.0, [1])
    with pytest.raises(DataValidationError) as err:
        turn_grpo(rows[:2] + [no_turns], AdvantageSettings())
    assert err.value.rollout_id == "b" and err.value.field == "rows[2].response_turns"
    clash = make_row("a", "g", 1.0, [1], turns=[1], turn_rewards=(0.5,), turn_index=1)
    with pytest.raises(DataValidationError, match="call 1 has two different rewards"):
        turn_grpo(_trajectory_rows((0.0, 1.0, 0.0)) + [clash], AdvantageSettings())
