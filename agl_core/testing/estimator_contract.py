"""The advantage-estimator contract: what every estimator must do with the rows of a step.

Subclass :class:`AdvantageEstimatorContract` in a ``test_*.py`` file::

    import my_package
    from agl_core.testing.contracts import AdvantageEstimatorContract

    class TestMyEstimator(AdvantageEstimatorContract):
        estimator_name = "my_estimator"
        plugins = (my_package,)

and declare what kind of estimator it is: ``per_turn = True`` when each model call gets its own
advantage (it reads ``response_turns``), ``baseline = False`` when it compares no rollout with its
group (``reinforce``), ``min_group_size`` the fewest rollouts per group it accepts.

The properties, on rows from :func:`~agl_core.testing.strategies.grouped_rows`:

- the result is an :class:`~agl_core.stages.advantage.Advantages` with one read-only, finite float32 array per row,
  as long as the row's response and zero wherever its ``response_mask`` is 0;
- a rollout-level estimator puts one value on every trained token of every row of a rollout; a
  per-turn one, one value per call of a rollout;
- the advantages do not depend on the order of rows, rollouts or groups;
- a baseline estimator gives exactly zero (within 1e-6) to a group whose rollouts all have one
  reward and no per-call rewards;
- the rows are not mutated nor reordered;
- rows of one rollout that disagree on reward or group are refused by an error naming the rollout;
  a group smaller than ``min_group_size`` by an error naming the group.

Each ``check_*`` function raises ``AssertionError`` saying what was expected; call them directly in
property tests of your own.
"""

from __future__ import annotations

from agl_core.testing import hypothesis_missing

try:
    from hypothesis import given
    from hypothesis import strategies as st
except ModuleNotFoundError as exc:
    raise hypothesis_missing(__name__) from exc

import uuid
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
import pytest

from agl_core.data import TrainingRow
from agl_core.stages.advantage import Advantages, AdvantageSettings
from agl_core.testing.lookup import PluginContract
from agl_core.testing.snapshots import describe_change, shorten, snapshot
from agl_core.testing.strategies import CONTRACT_SETTINGS, advantage_settings, grouped_rows

__all__ = [
    "AdvantageEstimatorContract",
    "check_advantages",
    "check_credit",
    "check_equal_rewards_give_zero",
    "check_errors_name_the_rollout_or_group",
    "check_order_does_not_matter",
    "check_rows_unchanged",
]

Estimate = Callable[[Sequence[TrainingRow], AdvantageSettings], Advantages]
TOLERANCE = 1e-5


def _where(row: TrainingRow) -> str:
    return f"rollout {row.rollout_id!r} (group {row.group_id!r}, row starting at call {row.turn_index})"


def check_advantages(rows: Sequence[TrainingRow], result: Any) -> None:
    """One read-only, finite float32 array per row, its response's length, zero on untrained tokens."""
    if not isinstance(result, Advantages):
        raise AssertionError(f"an estimator must return an Advantages, got {type(result).__name__}")
    if len(result.per_row) != len(rows):
        raise AssertionError(f"{len(result.per_row)} advantage arrays for {len(rows)} rows; expected one per row, in row order")
    for row, values in zip(rows, result.per_row):
        if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.shape != row.response_mask.shape:
            got = f"{type(values).__name__} {getattr(values, 'dtype', '')} {getattr(values, 'shape', '')}"
            raise AssertionError(f"{_where(row)}: advantages are {got}, expected float32 of shape {row.response_mask.shape}")
        if values.flags.writeable:
            raise AssertionError(f"{_where(row)}: the advantage array is writeable; return read-only arrays (agl_core.broadcast does)")
        if not np.all(np.isfinite(values)):
            raise AssertionError(f"{_where(row)}: advantages {shorten(values)} are not all finite")
        if np.any(values[row.response_mask == 0] != 0):
            raise AssertionError(
                f"{_where(row)}: untrained tokens (mask {shorten(row.response_mask)}) get advantages {shorten(values)}; expected 0 there"
            )
    for name, value in result.metrics.items():
        if not isinstance(name, str) or not np.isfinite(float(value)):
            raise AssertionError(f"metric {name!r} = {value!r}; metrics map names to finite numbers")


def check_credit(rows: Sequence[TrainingRow], result: Advantages, per_turn: bool) -> None:
    """One value per rollout over its trained tokens (per call of the rollout when ``per_turn``)."""
    seen: dict[tuple[str, int], tuple[float, TrainingRow]] = {}
    unit = "call" if per_turn else "rollout"
    for row, values in zip(rows, result.per_row):
        trained = row.response_mask == 1
        calls = row.response_turns[trained] if per_turn else np.zeros(int(trained.sum()), dtype=np.int64)
        for call, value in zip(calls.tolist(), values[trained].tolist()):
            first = seen.setdefault((row.rollout_id, call), (value, row))
            if abs(first[0] - value) > TOLERANCE * max(1.0, abs(value)):
                at = f" call {call}" if per_turn else ""
                raise AssertionError(
                    f"{_where(row)}: trained tokens of one {unit} get different advantages ({first[0]} and {value}"
                    f"{at}); a {'per-turn' if per_turn else 'rollout-level'} estimator gives each {unit} one value"
                    + ("" if per_turn else " (set per_turn = True on the contract test if it credits calls separately)")
                )


def _per_row(estimate: Estimate, rows: Sequence[TrainingRow], settings: AdvantageSettings) -> list[np.ndarray]:
    result = estimate(list(rows), settings)
    check_advantages(rows, result)
    return list(result.per_row)


def check_order_does_not_matter(estimate: Estimate, rows: Sequence[TrainingRow], settings: AdvantageSettings, order: Sequence[int]) -> None:
    """The rows in ``order`` get the advantages they got in their original order."""
    first = _per_row(estimate, rows, settings)
    again = _per_row(estimate, [rows[i] for i in order], settings)
    for position, i in enumerate(order):
        if not np.allclose(again[position], first[i], rtol=TOLERANCE, atol=TOLERANCE):
            raise AssertionError(
                f"{_where(rows[i])}: advantages {shorten(first[i])} become {shorten(again[position])} when the rows are "
                f"reordered; an estimator must not depend on the order of rows, rollouts or groups"
            )


def check_equal_rewards_give_zero(estimate: Estimate, rows: Sequence[TrainingRow], settings: AdvantageSettings) -> None:
    """With one reward per group and no per-call rewards (``gamma`` 1), every advantage is 0."""
    reward_of: dict[str, float] = {}
    equal = [
        attrs.evolve(row, reward=reward_of.setdefault(row.group_id, row.reward), turn_rewards=(None,) * len(row.turn_rewards))
        for row in rows
    ]
    for row, values in zip(equal, _per_row(estimate, equal, attrs.evolve(settings, gamma=1.0))):
        if np.max(np.abs(values), initial=0.0) > 1e-6:
            raise AssertionError(
                f"{_where(row)}: every rollout of group {row.group_id!r} has reward {row.reward}, yet the advantages are "
                f"{shorten(values)}; a baseline estimator gives such a group 0 (set baseline = False if it has no baseline)"
            )


def check_rows_unchanged(estimate: Estimate, rows: list[TrainingRow], settings: AdvantageSettings) -> None:
    """The estimator neither changes nor reorders the rows it is given."""
    before = snapshot(rows)
    estimate(rows, settings)
    change = describe_change(before, snapshot(rows), "rows", "rollout_id")
    if change:
        raise AssertionError(f"the estimator changed its input: {change}")


def _refused(estimate: Estimate, rows: list[TrainingRow], settings: AdvantageSettings, name: str, why: str) -> None:
    try:
        estimate(rows, settings)
    except Exception as exc:  # any error will do, as long as it names the culprit
        if name not in str(exc):
            raise AssertionError(f"{why}: the error should name {name!r}, it says: {exc}") from exc
        return
    raise AssertionError(f"{why}: expected an error naming {name!r}, the estimator returned advantages")


def check_errors_name_the_rollout_or_group(
    estimate: Estimate, rows: Sequence[TrainingRow], settings: AdvantageSettings, min_group_size: int
) -> None:
    """Rows of one rollout that disagree on reward or group are refused naming the rollout; a group
    below ``min_group_size`` rollouts is refused naming the group."""
    row = rows[0]
    rid = row.rollout_id
    _refused(estimate, [*rows, attrs.evolve(row, reward=row.reward + 1.0)], settings, rid, f"rows of rollout {rid!r} disagree on reward")
    _refused(estimate, [*rows, attrs.evolve(row, group_id=str(uuid.uuid4()))], settings, rid, f"rows of rollout {rid!r} disagree on group")
    if min_group_size > 1:
        lonely = f"lonely-{uuid.uuid4()}"
        moved = [attrs.evolve(r, group_id=lonely) if r.rollout_id == rid else r for r in rows]
        _refused(estimate, moved, settings, lonely, f"group {lonely!r} has 1 rollout, fewer than min_group_size = {min_group_size}")


class AdvantageEstimatorContract(PluginContract):
    """Base test class: subclass it, set ``estimator_name`` (and ``plugins``), and pytest runs the contract."""

    registry, name_attribute = "advantage_estimators", "estimator_name"
    estimator_name: ClassVar[str] = ""
    #: True when each model call of a rollout gets its own advantage (``turn_grpo``).
    per_turn: ClassVar[bool] = False
    #: False for an estimator without a group baseline (``reinforce``).
    baseline: ClassVar[bool] = True
    #: the fewest rollouts per group the estimator accepts.
    min_group_size: ClassVar[int] = 2

    def estimate(self, rows: Sequence[TrainingRow], settings: AdvantageSettings) -> Advantages:
        return self.plugin_under_test()(rows, settings)

    @given(data=st.data(), settings=advantage_settings())
    @CONTRACT_SETTINGS
    def test_advantages_are_finite_and_on_trained_tokens_only(self, data, settings):
        rows = data.draw(grouped_rows(min_group_size=self.min_group_size), "rows")
        check_advantages(rows, self.estimate(rows, settings))

    @given(data=st.data(), settings=advantage_settings())
    @CONTRACT_SETTINGS
    def test_one_value_per_rollout_or_per_call(self, data, settings):
        rows = data.draw(grouped_rows(min_group_size=self.min_group_size), "rows")
        result = self.estimate(rows, settings)
        check_advantages(rows, result)
        check_credit(rows, result, self.per_turn)

    @given(data=st.data(), settings=advantage_settings())
    @CONTRACT_SETTINGS
    def test_order_of_rows_rollouts_and_groups_does_not_matter(self, data, settings):
        rows = data.draw(grouped_rows(min_group_size=self.min_group_size), "rows")
        order = data.draw(st.permutations(range(len(rows))), "order")
        check_order_does_not_matter(self.estimate, rows, settings, order)

    @given(data=st.data(), settings=advantage_settings())
    @CONTRACT_SETTINGS
    def test_equal_rewards_in_a_group_give_zero_advantage(self, data, settings):
        if not self.baseline:
            pytest.skip("the estimator declares no baseline (baseline = False)")
        rows = data.draw(grouped_rows(min_group_size=self.min_group_size), "rows")
        check_equal_rewards_give_zero(self.estimate, rows, settings)

    @given(data=st.data(), settings=advantage_settings())
    @CONTRACT_SETTINGS
    def test_input_is_not_mutated(self, data, settings):
        rows = data.draw(grouped_rows(min_group_size=self.min_group_size), "rows")
        check_rows_unchanged(self.estimate, rows, settings)

    @given(data=st.data(), settings=advantage_settings())
    @CONTRACT_SETTINGS
    def test_errors_name_the_rollout_or_group(self, data, settings):
        rows = data.draw(grouped_rows(min_group_size=self.min_group_size), "rows")
        check_errors_name_the_rollout_or_group(self.estimate, rows, settings, self.min_group_size)
