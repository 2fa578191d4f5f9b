"""Every built-in advantage estimator passes the shipped contract, and the contract catches a gallery
of realistic estimator bugs, each by the property named beside it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import Phase, find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from agl_core import (
    AdvantageError,
    Advantages,
    AdvantageSettings,
    PluginManager,
    broadcast,
    group_rollouts,
    rollout_level,
)
from agl_core.builtins.estimators import grpo
from agl_core.testing.contracts import AdvantageEstimatorContract
from agl_core.testing.estimator_contract import (
    EstimatorCase,
    check_advantages,
    check_credit,
    check_equal_rewards_give_zero,
    check_errors_name_the_rollout_or_group,
    check_order_does_not_matter,
    check_rows_unchanged,
)
from agl_core.testing.strategies import advantage_settings, grouped_rows


class TestGrpoContract(AdvantageEstimatorContract):
    estimator_name = "grpo"
    family = "group_relative"
    cases = (
        # centred rewards +-0.5 over their std (ddof 1) sqrt(0.5): +-0.70711
        EstimatorCase({"g": [(1.0, 3), (0.0, 2)]}, {"g": [0.707106, -0.707106]}),
        EstimatorCase(
            {"g": [(1.0, 3), (0.0, 2), (0.5, 1)]}, {"g": [0.5, -0.5, 0.0]}, AdvantageSettings(norm_adv_by_std=False)
        ),
    )


class TestRlooContract(AdvantageEstimatorContract):
    estimator_name = "rloo"
    family = "leave_one_out"
    cases = (EstimatorCase({"g": [(1.0, 3), (0.0, 2), (0.5, 1)]}, {"g": [0.75, -0.75, 0.0]}),)


class TestReinforceContract(AdvantageEstimatorContract):
    estimator_name = "reinforce"
    baseline = False
    min_group_size = 1


class TestReinforceBaselineContract(AdvantageEstimatorContract):
    estimator_name = "reinforce_baseline"


class TestTurnGrpoContract(AdvantageEstimatorContract):
    estimator_name = "turn_grpo"
    per_turn = True


def test_every_built_in_estimator_has_a_contract_test():
    tested = {cls.estimator_name for cls in AdvantageEstimatorContract.__subclasses__() if cls.__module__ == __name__}
    assert tested == set(PluginManager(load_entrypoints=False).advantage_estimators.names())


# -- the gallery: realistic bugs, each caught by one named property -------------------------------


def _by_group(rows, advantage_of):
    """Advantages from ``advantage_of(rewards of a group, index in it)``, without any validation."""
    reward, groups = {}, {}
    for row in rows:
        reward[row.rollout_id] = row.reward
        groups.setdefault(row.group_id, [])
        if row.rollout_id not in groups[row.group_id]:
            groups[row.group_id].append(row.rollout_id)
    value = {}
    for rids in groups.values():
        rewards = np.array([reward[r] for r in rids])
        value.update({rid: advantage_of(rewards, k) for k, rid in enumerate(rids)})
    return Advantages(per_row=tuple(broadcast(row, value[row.rollout_id]) for row in rows))


def sorts_rows_in_place(rows, s):
    rows.sort(key=lambda row: row.rollout_id)
    return grpo(rows, s)


def normalises_each_row_by_its_length(rows, s):
    result = grpo(rows, s)
    per_row = []
    for row, values in zip(rows, result.per_row):
        scaled = values / np.float32(row.n_trained_tokens)
        scaled.flags.writeable = False
        per_row.append(scaled)
    return Advantages(per_row=tuple(per_row))


def batch_mean_baseline(rows, s):
    mean = np.mean([row.reward for row in rows])
    return Advantages(per_row=tuple(broadcast(row, row.reward - mean) for row in rows))


def std_without_epsilon(rows, s):
    return rollout_level(rows, "no_eps", 2, lambda r: (r - r.mean()) / r.std(ddof=1))


def first_rollout_baseline(rows, s):
    return _by_group(rows, lambda rewards, k: rewards[k] - rewards[0])


def advantage_on_observations(rows, s):
    result = grpo(rows, s)
    per_row = []
    for values in result.per_row:
        filled = np.full(values.shape, values.max() if values.size else 0.0, dtype=np.float32)
        filled.flags.writeable = False
        per_row.append(filled)
    return Advantages(per_row=tuple(per_row))


def anonymous_group_error(rows, s):
    for rids in group_rollouts(rows).groups.values():
        if len(rids) < 2:
            raise AdvantageError("a group is too small for this estimator")
    return grpo(rows, s)


def averages_disagreeing_rows(rows, s):
    return _by_group(rows, lambda rewards, k: rewards[k] - rewards.mean())


GALLERY = {
    "sorts the rows in place by rollout id": (sorts_rows_in_place, "input_is_not_mutated"),
    "normalises each row by its own token count": (normalises_each_row_by_its_length, "one_value_per_rollout"),
    "baseline is the batch mean, not the group's": (batch_mean_baseline, "equal_rewards_give_zero"),
    "divides by the std with no epsilon": (std_without_epsilon, "finite_on_trained_tokens"),
    "baseline is the group's first rollout in input order": (first_rollout_baseline, "order_does_not_matter"),
    "puts the advantage on observation tokens too": (advantage_on_observations, "finite_on_trained_tokens"),
    "a too-small group error that does not name the group": (anonymous_group_error, "errors_name_the_rollout_or_group"),
    "averages the rewards of rows that disagree": (averages_disagreeing_rows, "errors_name_the_rollout_or_group"),
}

PROPERTIES = {
    "finite_on_trained_tokens": lambda estimate, rows, s, order: check_advantages(rows, estimate(list(rows), s)),
    "one_value_per_rollout": lambda estimate, rows, s, order: check_credit(
        rows, estimate(list(rows), s), per_turn=False
    ),
    "order_does_not_matter": lambda estimate, rows, s, order: check_order_does_not_matter(estimate, rows, s, order),
    "equal_rewards_give_zero": lambda estimate, rows, s, order: check_equal_rewards_give_zero(estimate, rows, s),
    "input_is_not_mutated": lambda estimate, rows, s, order: check_rows_unchanged(estimate, list(rows), s),
    "errors_name_the_rollout_or_group": lambda estimate, rows, s, order: check_errors_name_the_rollout_or_group(
        estimate, rows, s, 2
    ),
}


@st.composite
def cases(draw):
    rows = draw(grouped_rows(min_group_size=2))
    return rows, draw(advantage_settings()), draw(st.permutations(range(len(rows))))


def caught(estimate, prop):
    """Whether property ``prop`` fails ``estimate`` on some generated case (generation only: the first
    failing case is enough)."""

    def fails(case):
        rows, s, order = case
        try:
            PROPERTIES[prop](estimate, rows, s, order)
        except AssertionError:
            return True
        return False

    try:
        find(cases(), fails, settings=settings(max_examples=1000, database=None, phases=[Phase.generate]))
    except NoSuchExample:
        return False
    return True


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the no-epsilon bug divides 0 by 0
@pytest.mark.parametrize("bug", sorted(GALLERY))
def test_the_contract_catches_a_planted_bug_by_its_property(bug):
    estimate, prop = GALLERY[bug]
    assert caught(estimate, prop), f"{bug!r} slipped past {prop}"
