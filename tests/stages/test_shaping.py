"""Batch shaping: whole mini-batches, whole rollouts, zero-variance groups dropped first, honest counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_core.builtins.estimators import grpo
from agl_core.config import default_config
from agl_core.data import TrainingRow
from agl_core.stages.advantage import AdvantageSettings
from agl_core.stages.shaping import ShapingSettings, shape_batch


def make_row(rollout_id, group_id, reward, n_tokens=2, dropped=False):
    return TrainingRow(
        prompt_ids=[1],
        response_ids=[2] * n_tokens,
        response_mask=[1] * n_tokens,
        reward=reward,
        rollout_id=rollout_id,
        group_id=group_id,
        dropped=dropped,
    )


@st.composite
def collected(draw, max_rows_per_rollout=3):
    """Groups of 2-4 rollouts with rewards from a small set (so zero-variance groups are common),
    1..max_rows_per_rollout rows each, a few rows marked dropped."""
    rows = []
    for g in range(draw(st.integers(1, 6))):
        for r in range(draw(st.integers(2, 4))):
            reward = draw(st.sampled_from([0.0, 1.0]))
            for _ in range(draw(st.integers(1, max_rows_per_rollout))):
                rows.append(make_row(f"g{g}r{r}", f"g{g}", reward, dropped=draw(st.integers(0, 14)) == 0))
    order = draw(st.permutations(range(len(rows))))
    return [rows[i] for i in order]


shaping = st.builds(
    ShapingSettings,
    mini_batch_rows=st.integers(1, 8),
    max_updates=st.none() | st.integers(1, 4),
    seed=st.tuples(st.integers(0, 2**16)),
)


def _rollout_rows(rows):
    out: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        out.setdefault(row.rollout_id, []).append(i)
    return out


def _subset_sums(sizes):
    sums = {0}
    for s in sizes:
        sums |= {x + s for x in sums}
    return sums


def _check_invariants(rows, shaped, s):
    by_rollout = _rollout_rows(rows)
    kept = set(shaped.kept_indices)
    marked = {rid for rid, idx in by_rollout.items() if any(rows[i].dropped for i in idx)}
    for rid, idx in by_rollout.items():
        assert all(i in kept for i in idx) or not any(i in kept for i in idx), f"rollout {rid} was split"
        if rid in marked:
            assert not any(i in kept for i in idx)
    n = len(shaped.kept_indices)
    assert n % s.mini_batch_rows == 0 and shaped.n_mini_batches == n // s.mini_batch_rows
    if s.max_updates is not None:
        assert shaped.n_mini_batches <= s.max_updates
    # The largest whole number of mini-batches that whole rollouts can fill is kept.
    candidates = [len(idx) for rid, idx in by_rollout.items() if rid not in marked]
    cap = sum(candidates) // s.mini_batch_rows if s.max_updates is None else s.max_updates
    feasible = [t for t in _subset_sums(candidates) if t % s.mini_batch_rows == 0 and t // s.mini_batch_rows <= cap]
    assert n == max(feasible)
    m = shaped.metrics
    assert m["training/n_sample_collected"] == len(rows)
    assert m["training/n_sample_trained"] == n
    assert m["training/n_sample_collected"] == (
        n
        + m["training/n_sample_dropped/marked"]
        + m["training/n_sample_dropped/same_reward"]
        + m["training/n_sample_dropped/random"]
    )
    assert m["training/n_sample_dropped/marked"] == sum(len(by_rollout[r]) for r in marked)
    assert shaped.rows == tuple(rows[i] for i in shaped.kept_indices)
    assert list(shaped.kept_indices) == sorted(shaped.kept_indices)


def _zero_variance_groups(rows):
    rewards: dict[str, set[float]] = {}
    for row in rows:
        rewards.setdefault(row.group_id, set()).add(row.reward)
    return {g for g, r in rewards.items() if len(r) == 1}


@settings(max_examples=120, deadline=None)
@given(rows=collected(), s=shaping)
def test_shaping_keeps_whole_rollouts_in_whole_mini_batches(rows, s):
    shaped = shape_batch(rows, grpo(rows, AdvantageSettings()), s)
    _check_invariants(rows, shaped, s)
    # Zero-variance rollouts go first: a rollout of a group with variance is never dropped while a
    # zero-variance rollout of the same row count is kept (swapping them would fit as well).
    flat = _zero_variance_groups(rows)
    by_rollout = _rollout_rows(rows)
    kept = set(shaped.kept_indices)
    marked = {rid for rid, idx in by_rollout.items() if any(rows[i].dropped for i in idx)}
    dropped_sizes = {
        len(idx)
        for rid, idx in by_rollout.items()
        if rid not in marked and idx[0] not in kept and rows[idx[0]].group_id not in flat
    }
    kept_flat_sizes = {len(idx) for idx in by_rollout.values() if idx[0] in kept and rows[idx[0]].group_id in flat}
    assert not dropped_sizes & kept_flat_sizes
    again = shape_batch(rows, grpo(rows, AdvantageSettings()), s)  # seeded: reproducible
    assert (again.kept_indices, again.metrics) == (shaped.kept_indices, shaped.metrics)


@settings(max_examples=120, deadline=None)
@given(rows=collected(max_rows_per_rollout=1), s=shaping)
def test_with_single_row_rollouts_exactly_the_zero_variance_rows_go_first(rows, s):
    shaped = shape_batch(rows, grpo(rows, AdvantageSettings()), s)
    _check_invariants(rows, shaped, s)
    flat = _zero_variance_groups(rows)
    candidates = [r for r in rows if not r.dropped]
    to_drop = len(candidates) - len(shaped.kept_indices)
    flat_rows = sum(1 for r in candidates if r.group_id in flat)
    assert shaped.metrics["training/n_sample_dropped/same_reward"] == min(to_drop, flat_rows)
    assert shaped.metrics["training/n_sample_dropped/random"] == to_drop - min(to_drop, flat_rows)


def test_a_rollout_with_more_rows_than_fit_goes_whole():
    # Mini-batches of 4 rows; rollouts of 3, 3 and 1 rows (7 rows): 4 rows can be kept only as
    # {3, 1}, so one 3-row rollout goes whole rather than being cut to fill a second mini-batch.
    rows = [make_row("a", "g", 1.0)] * 3 + [make_row("b", "g", 0.0)] * 3 + [make_row("c", "g", 0.0)]
    shaped = shape_batch(rows, grpo(rows, AdvantageSettings()), ShapingSettings(mini_batch_rows=4))
    kept = {row.rollout_id for row in shaped.rows}
    assert len(shaped.rows) == 4 and "c" in kept and len(kept) == 2
    # Three 3-row rollouts cannot fill any 4-row mini-batch: nothing is trained, all is counted.
    rows = [make_row(r, "g", float(i)) for i, r in enumerate("abc") for _ in range(3)]
    shaped = shape_batch(rows, grpo(rows, AdvantageSettings()), ShapingSettings(mini_batch_rows=4))
    assert shaped.rows == () and shaped.n_mini_batches == 0
    assert shaped.metrics["training/n_sample_dropped/random"] == 9


def test_marked_rows_remove_their_rollout_and_groups_are_counted():
    rows = [
        make_row("a", "g", 1.0),
        make_row("b", "g", 0.0),
        make_row("b", "g", 0.0, dropped=True),
        make_row("c", "flat", 1.0),
        make_row("d", "flat", 1.0),
    ]
    advantages = grpo(rows, AdvantageSettings())  # computed on everything collected
    shaped = shape_batch(rows, advantages, ShapingSettings(mini_batch_rows=1, max_updates=2))
    assert [row.rollout_id for row in shaped.rows] == ["a", "c"] or [row.rollout_id for row in shaped.rows] == [
        "a",
        "d",
    ]
    assert shaped.advantages[0][0] == advantages.per_row[0][0] > 0  # a's advantage kept b in its baseline
    assert shaped.metrics == {
        "training/n_sample_collected": 5.0,
        "training/n_sample_trained": 2.0,
        "training/n_sample_dropped/marked": 2.0,
        "training/n_sample_dropped/same_reward": 1.0,
        "training/n_sample_dropped/random": 0.0,
        "training/n_groups": 2.0,
        "training/n_zero_adv_groups": 1.0,
    }
    np.testing.assert_allclose(shaped.row_scales("rollouts"), [2 / (2 * 2), 2 / (2 * 2)])


def test_settings_from_config_and_bad_inputs():
    cfg = default_config()
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    cfg.actor_rollout_ref.rollout.n = 3
    cfg.agentlightning.max_ppo_update_times = 2
    assert ShapingSettings.from_config(cfg, step=7) == ShapingSettings(mini_batch_rows=12, max_updates=2, seed=(0, 7))
    rows = [make_row("a", "g", 1.0), make_row("b", "g", 0.0)]
    with pytest.raises(ValueError, match="advantages for 1 rows"):
        shape_batch(rows, [np.zeros(2, np.float32)], ShapingSettings(mini_batch_rows=1))
    with pytest.raises(ValueError, match=r"advantages\[1\] has shape \(3,\)"):
        shape_batch(rows, [np.zeros(2, np.float32), np.zeros(3, np.float32)], ShapingSettings(mini_batch_rows=1))
