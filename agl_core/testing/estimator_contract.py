"""The advantage-estimator contract: what every estimator must do with the rows of a step.

Subclass :class:`AdvantageEstimatorContract` in a ``test_*.py`` file::

    import my_package
    from agl_core.testing.contracts import AdvantageEstimatorContract

    class TestMyEstimator(AdvantageEstimatorContract):
        estimator_name = "my_estimator"
        plugins = (my_package,)

and declare what kind of estimator it is: ``per_turn = True`` when each model call gets its own
advantage (it reads ``response_turns``), ``baseline = False`` when it compares no rollout with its
group (``reinforce``), ``min_group_size`` the fewest rollouts per group it accepts. Declarations
that follow from its formula add checks (and switch none off):

- ``family = "group_relative"``: adding one constant to every reward of a group changes nothing;
- ``family = "leave_one_out"``: each rollout is compared with the mean of the *others* (raising one
  rollout's reward by ``d`` raises its advantage by exactly ``d`` and lowers each other's by
  ``d / (n - 1)``); it is group-relative too;
- ``length_penalty = True``: the reward is shaped by the number of *trained* tokens: of two
  otherwise identical rollouts the longer gets the lower advantage, and untrained (observation)
  tokens change nothing. Identical rollouts still get zero advantage.

Reference mode: set ``reference`` to a slow, obviously-correct estimator (same signature) and
every generated batch is compared with it, and/or ``cases`` to hand-computed
:class:`EstimatorCase` tables.

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
import pytest

from agl_core.data import TrainingRow
from agl_core.errors import UsageError
from agl_core.stages.advantage import Advantages, AdvantageSettings
from agl_core.testing.lookup import PluginContract
from agl_core.testing.reference import array_diff
from agl_core.testing.snapshots import describe_change, shorten, snapshot
from agl_core.testing.strategies import CONTRACT_SETTINGS, advantage_settings, grouped_rows

__all__ = [
    "AdvantageEstimatorContract",
    "EstimatorCase",
    "check_advantages",
    "check_case",
    "check_identical_rollouts_give_zero",
    "check_leave_one_out",
    "check_length_penalty",
    "check_matches_reference",
    "check_shift_invariance",
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
        raise AssertionError(
            f"{len(result.per_row)} advantage arrays for {len(rows)} rows; expected one per row, in row order"
        )
    for row, values in zip(rows, result.per_row):
        if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.shape != row.response_mask.shape:
            got = f"{type(values).__name__} {getattr(values, 'dtype', '')} {getattr(values, 'shape', '')}"
            raise AssertionError(
                f"{_where(row)}: advantages are {got}, expected float32 of shape {row.response_mask.shape}"
            )
        if values.flags.writeable:
            raise AssertionError(
                f"{_where(row)}: the advantage array is writeable; return read-only arrays (agl_core.broadcast does)"
            )
        if not np.all(np.isfinite(values)):
            raise AssertionError(f"{_where(row)}: advantages {shorten(values)} are not all finite")
        if np.any(values[row.response_mask == 0] != 0):
            raise AssertionError(
                f"{_where(row)}: untrained tokens (mask {shorten(row.response_mask)}) get advantages "
                f"{shorten(values)}; expected 0 there"
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


def check_order_does_not_matter(
    estimate: Estimate, rows: Sequence[TrainingRow], settings: AdvantageSettings, order: Sequence[int]
) -> None:
    """The rows in ``order`` get the advantages they got in their original order."""
    first = _per_row(estimate, rows, settings)
    again = _per_row(estimate, [rows[i] for i in order], settings)
    for position, i in enumerate(order):
        if not np.allclose(again[position], first[i], rtol=TOLERANCE, atol=TOLERANCE):
            raise AssertionError(
                f"{_where(rows[i])}: advantages {shorten(first[i])} become {shorten(again[position])} when the "
                "rows are "
                f"reordered; an estimator must not depend on the order of rows, rollouts or groups"
            )


def check_equal_rewards_give_zero(estimate: Estimate, rows: Sequence[TrainingRow], settings: AdvantageSettings) -> None:
    """With one reward per group and no per-call rewards (``gamma`` 1), every advantage is 0."""
    reward_of: dict[str, float] = {}
    equal = [
        attrs.evolve(
            row, reward=reward_of.setdefault(row.group_id, row.reward), turn_rewards=(None,) * len(row.turn_rewards)
        )
        for row in rows
    ]
    for row, values in zip(equal, _per_row(estimate, equal, attrs.evolve(settings, gamma=1.0))):
        if np.max(np.abs(values), initial=0.0) > 1e-6:
            raise AssertionError(
                f"{_where(row)}: every rollout of group {row.group_id!r} has reward {row.reward}, yet the "
                "advantages are "
                f"{shorten(values)}; a baseline estimator gives such a group 0 (set baseline = False if it has "
                "no baseline)"
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
    _refused(
        estimate,
        [*rows, attrs.evolve(row, reward=row.reward + 1.0)],
        settings,
        rid,
        f"rows of rollout {rid!r} disagree on reward",
    )
    _refused(
        estimate,
        [*rows, attrs.evolve(row, group_id=str(uuid.uuid4()))],
        settings,
        rid,
        f"rows of rollout {rid!r} disagree on group",
    )
    if min_group_size > 1:
        lonely = f"lonely-{uuid.uuid4()}"
        moved = [attrs.evolve(r, group_id=lonely) if r.rollout_id == rid else r for r in rows]
        _refused(
            estimate,
            moved,
            settings,
            lonely,
            f"group {lonely!r} has 1 rollout, fewer than min_group_size = {min_group_size}",
        )


def _rollout_values(rows: Sequence[TrainingRow], result: Advantages) -> dict[str, float]:
    """Each rollout's advantage: the value on its first trained token (rollout-level estimators)."""
    values: dict[str, float] = {}
    for row, adv in zip(rows, result.per_row):
        trained = np.flatnonzero(row.response_mask == 1)
        if trained.size:
            values.setdefault(row.rollout_id, float(adv[trained[0]]))
    return values


def _groups(rows: Sequence[TrainingRow]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for row in rows:
        members = groups.setdefault(row.group_id, [])
        if row.rollout_id not in members:
            members.append(row.rollout_id)
    return groups


def check_matches_reference(
    estimate: Estimate, reference: Estimate, rows: Sequence[TrainingRow], settings: AdvantageSettings
) -> None:
    """The estimator's advantages equal the reference's on every row (a differential property)."""
    got = _per_row(estimate, rows, settings)
    want = reference(list(rows), settings).per_row
    for row, g, w in zip(rows, got, want):
        diff = array_diff(g, w, rtol=TOLERANCE, atol=TOLERANCE)
        if diff:
            raise AssertionError(
                f"{_where(row)} (reward {row.reward}, {row.n_trained_tokens} trained tokens, settings "
                f"{settings}): the advantages "
                f"differ from the reference's: {diff}"
            )


def check_shift_invariance(
    estimate: Estimate, rows: Sequence[TrainingRow], settings: AdvantageSettings, shift: float
) -> None:
    """A group-relative estimator: adding ``shift`` to every reward of the first group changes nothing."""
    group = rows[0].group_id
    shifted = [attrs.evolve(row, reward=row.reward + shift) if row.group_id == group else row for row in rows]
    before, after = _per_row(estimate, rows, settings), _per_row(estimate, shifted, settings)
    for row, b, a in zip(rows, before, after):
        diff = array_diff(a, b, rtol=TOLERANCE, atol=TOLERANCE)
        if diff:
            raise AssertionError(
                f"{_where(row)}: adding {shift} to every reward of group {group!r} changes the advantages ({diff}); "
                "a group-relative estimator (family = 'group_relative') depends only on rewards relative to the group"
            )


def check_leave_one_out(
    estimate: Estimate, rows: Sequence[TrainingRow], settings: AdvantageSettings, raise_by: float
) -> None:
    """Raising one rollout's reward by ``raise_by`` raises its advantage by exactly that and lowers
    each other rollout of its group by ``raise_by / (n - 1)``: its baseline leaves it out."""
    groups = _groups(rows)
    group, members = next(((g, m) for g, m in groups.items() if len(m) >= 2), (None, []))
    if group is None:
        return
    target, n = members[0], len(members)
    raised = [attrs.evolve(row, reward=row.reward + raise_by) if row.rollout_id == target else row for row in rows]
    before = _rollout_values(rows, estimate(list(rows), settings))
    after = _rollout_values(raised, estimate(raised, settings))
    for rid in members:
        expected = raise_by if rid == target else -raise_by / (n - 1)
        change = after[rid] - before[rid]
        if abs(change - expected) > 1e-4 * max(1.0, abs(raise_by)):
            who = "its own" if rid == target else f"rollout {rid!r}'s (same group)"
            raise AssertionError(
                f"raising the reward of rollout {target!r} (group {group!r}, {n} rollouts) by {raise_by} "
                f"changes {who} advantage "
                f"by {change:.6g}, expected {expected:.6g}: a leave-one-out baseline is the mean of the others' "
                "rewards, without the "
                f"rollout's own (advantage = reward - mean of the other {n - 1})"
            )


def _identical_group(rows: Sequence[TrainingRow]) -> list[TrainingRow]:
    """Every rollout of each group replaced by a copy of the group's first rollout (ids kept)."""
    groups = _groups(rows)
    template = {g: [row for row in rows if row.rollout_id == members[0]] for g, members in groups.items()}
    return [
        attrs.evolve(row, rollout_id=rid) for g, members in groups.items() for rid in members for row in template[g]
    ]


def _lengthened(row: TrainingRow, n: int, trained: bool) -> TrainingRow:
    """``row`` with ``n`` more response tokens at its end, of its last call, trained or not."""
    last = int(row.response_turns[-1]) if row.response_turns is not None and len(row.response_turns) else row.turn_index
    extend = lambda a, v: np.concatenate([a, np.full(n, v, dtype=a.dtype)])  # noqa: E731
    return attrs.evolve(
        row,
        response_ids=extend(row.response_ids, 1),
        response_mask=extend(row.response_mask, 1 if trained else 0),
        response_turns=None if row.response_turns is None else extend(row.response_turns, last),
        log_probs=None if row.log_probs is None else extend(row.log_probs, -1.0 if trained else 0.0),
    )


def check_identical_rollouts_give_zero(
    estimate: Estimate, rows: Sequence[TrainingRow], settings: AdvantageSettings
) -> None:
    """A group of identical rollouts (same reward, same tokens) gets zero advantage everywhere."""
    same = _identical_group(rows)
    for row, values in zip(same, _per_row(estimate, same, attrs.evolve(settings, gamma=1.0))):
        if np.max(np.abs(values), initial=0.0) > 1e-6:
            raise AssertionError(
                f"{_where(row)}: every rollout of group {row.group_id!r} is identical (reward {row.reward}, "
                "same tokens), yet the "
                f"advantages are {shorten(values)}; a baseline estimator gives such a group 0"
            )


def check_length_penalty(
    estimate: Estimate, rows: Sequence[TrainingRow], settings: AdvantageSettings, extra: int
) -> None:
    """In a group of identical rollouts, ``extra`` more trained tokens on one make its advantage the
    lowest of the group; ``extra`` more untrained tokens change nothing."""
    same = _identical_group(rows)
    members = _groups(same)
    group, ids = next(((g, m) for g, m in members.items() if len(m) >= 2), (None, []))
    if group is None:
        return
    target = ids[0]
    last_row = max((i for i, row in enumerate(same) if row.rollout_id == target), key=lambda i: same[i].turn_index)
    for trained in (False, True):
        changed = list(same)
        changed[last_row] = _lengthened(same[last_row], extra, trained)
        values = _rollout_values(changed, estimate(changed, attrs.evolve(settings, gamma=1.0)))
        others = [values[rid] for rid in ids if rid != target]
        if not trained and any(abs(v) > 1e-6 for v in values.values() if v is not None):
            raise AssertionError(
                f"in group {group!r} of identical rollouts, {extra} more untrained (observation) tokens on "
                f"rollout {target!r} give "
                f"advantages {shorten({rid: values[rid] for rid in ids})}, expected all 0: a length penalty "
                "counts only trained tokens"
            )
        if trained and not values[target] < min(others) - 1e-7:
            raise AssertionError(
                f"in group {group!r} of identical rollouts, rollout {target!r} with {extra} more trained tokens "
                "gets advantage "
                f"{values[target]:.6g}, the others {shorten(others)}; a length penalty must give the longer "
                "rollout the lower advantage"
            )


@attrs.frozen
class EstimatorCase:
    """A hand-computed case: per group, its rollouts as ``(reward, n_trained_tokens)``, and the
    advantage each should get (rollout-level estimators)."""

    groups: Mapping[str, Sequence[tuple[float, int]]]
    expected: Mapping[str, Sequence[float]]
    settings: AdvantageSettings = AdvantageSettings()

    def rows(self) -> list[TrainingRow]:
        return [
            TrainingRow(
                prompt_ids=[1],
                response_ids=[2] * n,
                response_mask=[1] * n,
                reward=reward,
                rollout_id=f"{group}-{i}",
                group_id=group,
                response_turns=[0] * n,
                turn_rewards=(None,),
            )
            for group, members in self.groups.items()
            for i, (reward, n) in enumerate(members)
        ]


def check_case(estimate: Estimate, case: EstimatorCase) -> None:
    """The estimator gives every rollout of ``case`` its hand-computed advantage."""
    rows = case.rows()
    got = _rollout_values(rows, estimate(rows, case.settings))
    for group, expected in case.expected.items():
        values = [got[f"{group}-{i}"] for i in range(len(expected))]
        diff = array_diff(values, expected, rtol=1e-4, atol=1e-5)
        if diff:
            raise AssertionError(
                f"group {group!r} (reward, trained tokens) = {list(case.groups[group])}, settings "
                f"{case.settings}: {diff}"
            )


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
    #: "group_relative" or "leave_one_out" (see the module docstring), or "" for neither.
    family: ClassVar[str] = ""
    #: True when the reward is shaped by the number of trained tokens (longer: lower).
    length_penalty: ClassVar[bool] = False
    #: a slow, obviously-correct estimator to compare with on every generated batch.
    reference: ClassVar[Estimate | None] = None
    #: hand-computed cases (:class:`~agl_core.testing.estimator_contract.EstimatorCase`) the estimator must reproduce.
    cases: ClassVar[Sequence[EstimatorCase]] = ()

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
        if self.length_penalty:  # equal rewards with unequal lengths differ: compare identical rollouts
            check_identical_rollouts_give_zero(self.estimate, rows, settings)
        else:
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

    @given(data=st.data(), settings=advantage_settings())
    @CONTRACT_SETTINGS
    def test_follows_its_family(self, data, settings):
        if self.family not in ("group_relative", "leave_one_out"):
            if self.family:
                raise UsageError(
                    f"{type(self).__name__}.family = {self.family!r}: expected 'group_relative', 'leave_one_out' or ''"
                )
            pytest.skip("the estimator declares no family (family = '')")
        rows = data.draw(grouped_rows(min_group_size=max(2, self.min_group_size)), "rows")
        check_shift_invariance(self.estimate, rows, settings, data.draw(st.sampled_from([-1.5, 0.25, 3.0]), "shift"))
        if self.family == "leave_one_out":
            check_leave_one_out(self.estimate, rows, settings, data.draw(st.sampled_from([-1.0, 0.5, 2.0]), "raise_by"))

    @given(data=st.data(), settings=advantage_settings())
    @CONTRACT_SETTINGS
    def test_length_penalty_counts_trained_tokens_only(self, data, settings):
        if not self.length_penalty:
            pytest.skip("the estimator declares no length penalty (length_penalty = False)")
        rows = data.draw(grouped_rows(min_group_size=max(2, self.min_group_size)), "rows")
        check_length_penalty(self.estimate, rows, settings, data.draw(st.integers(1, 6), "extra"))

    @given(data=st.data(), settings=advantage_settings())
    @CONTRACT_SETTINGS
    def test_matches_the_reference(self, data, settings):
        if type(self).reference is None:
            pytest.skip("no reference estimator given (reference = None)")
        rows = data.draw(grouped_rows(min_group_size=self.min_group_size), "rows")
        check_matches_reference(self.estimate, type(self).reference, rows, settings)

    def test_hand_computed_cases(self):
        if not self.cases:
            pytest.skip("no hand-computed cases given (cases = ())")
        for case in self.cases:
            check_case(self.estimate, case)
