"""Per-rollout normalisation: both formulas, equal rollout weights, and step scales vs mini-batch count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_core.config import ConfigError, load_config
from agl_core.stages.normalization import rollout_scales


@st.composite
def rollouts(draw):
    """(rollout id per row, trained tokens per row): 1-12 rollouts of 1-3 rows, 1-20 tokens each."""
    ids, tokens = [], []
    for r in range(draw(st.integers(1, 12))):
        for _ in range(draw(st.integers(1, 3))):
            ids.append(f"r{r}")
            tokens.append(draw(st.integers(1, 20)))
    order = draw(st.permutations(range(len(ids))))
    return [ids[i] for i in order], np.array([tokens[i] for i in order])


def _rollout_weights(ids, tokens, scales):
    weights: dict[str, float] = {}
    for rid, n, s in zip(ids, tokens, scales):
        weights[rid] = weights.get(rid, 0.0) + n * s
    return weights


def test_formulas_by_hand():
    ids = ["a", "a", "b"]
    tokens = [3, 1, 2]
    # rollouts: M / (T_r * R); upstream: 1 / (T_r * N)
    np.testing.assert_allclose(rollout_scales(ids, tokens, mode="rollouts", n_mini_batches=2), [2 / 8, 2 / 8, 2 / 4])
    np.testing.assert_allclose(rollout_scales(ids, tokens, mode="upstream", n_mini_batches=2), [1 / 12, 1 / 12, 1 / 6])


@settings(max_examples=80, deadline=None)
@given(batch=rollouts(), n_mini_batches=st.integers(1, 8))
def test_rollouts_mode_gives_every_rollout_the_same_total_weight(batch, n_mini_batches):
    ids, tokens = batch
    scales = rollout_scales(ids, tokens, mode="rollouts", n_mini_batches=n_mini_batches)
    weights = _rollout_weights(ids, tokens, scales)
    expected = n_mini_batches / len(weights)
    assert all(w == pytest.approx(expected, rel=1e-12) for w in weights.values())
    upstream = _rollout_weights(ids, tokens, rollout_scales(ids, tokens, mode="upstream", n_mini_batches=1))
    assert all(w == pytest.approx(1 / len(ids), rel=1e-12) for w in upstream.values())


@settings(max_examples=80, deadline=None)
@given(batch=rollouts(), data=st.data())
def test_a_steps_scale_does_not_depend_on_the_mini_batch_count(batch, data):
    """Cut the same batch into M mini-batches of R/M whole rollouts, for every M dividing R.

    In ``rollouts`` mode every optimizer step has total weight exactly 1, whatever M, and the per-step
    scales add up to the step count M. In ``upstream`` mode each step weighs about 1/M: it is the
    sum over the mini-batches that stays fixed (at R/N) while every step shrinks as M grows.
    """
    ids, tokens = batch
    names = sorted(set(ids))
    order = data.draw(st.permutations(names))
    n_rollouts = len(names)
    for mode in ("rollouts", "upstream"):
        step_scales_by_m = {}
        for m in [m for m in range(1, n_rollouts + 1) if n_rollouts % m == 0]:
            scales = rollout_scales(ids, tokens, mode=mode, n_mini_batches=m)
            per_step = n_rollouts // m
            step_of = {rid: order.index(rid) // per_step for rid in names}
            step_scales = np.zeros(m)
            for rid, n, s in zip(ids, tokens, scales):
                step_scales[step_of[rid]] += n * s
            step_scales_by_m[m] = step_scales
        if mode == "rollouts":
            for m, step_scales in step_scales_by_m.items():
                np.testing.assert_allclose(step_scales, 1.0, rtol=1e-12)
                assert step_scales.sum() == pytest.approx(m)
        else:
            for step_scales in step_scales_by_m.values():
                assert step_scales.sum() == pytest.approx(n_rollouts / len(ids))
                np.testing.assert_allclose(step_scales, n_rollouts / len(ids) / len(step_scales), rtol=1e-12)


def _upstream_reference(advantages, mask, ids):
    """Agent Lightning v1.0's scaling written out: each row / (its rollout's trained tokens × rows)."""
    out = advantages.clone()
    for i, rid in enumerate(ids):
        rollout_tokens = sum(int(mask[j].sum()) for j, other in enumerate(ids) if other == rid)
        out[i] = advantages[i] / max(rollout_tokens * len(ids), 1)
    return out


@settings(max_examples=40, deadline=None)
@given(batch=rollouts(), seed=st.integers(0, 1000), m=st.integers(1, 4))
def test_upstream_scales_on_padded_tensors_are_agent_lightnings(batch, seed, m):
    ids, tokens = batch
    length = int(tokens.max()) + 2
    mask = torch.zeros(len(ids), length, dtype=torch.bool)
    for i, n in enumerate(tokens):
        mask[i, :n] = True
    adv = torch.randn(len(ids), length, generator=torch.Generator().manual_seed(seed)) * mask
    scales = rollout_scales(ids, mask.sum(dim=-1).numpy(), mode="upstream", n_mini_batches=m)
    torch.testing.assert_close(
        adv * torch.as_tensor(scales, dtype=adv.dtype)[:, None], _upstream_reference(adv, mask, ids)
    )


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="agentlightning.loss_normalization"):
        rollout_scales(["a"], [1], mode="mean", n_mini_batches=1)
    with pytest.raises(ValueError, match="n_mini_batches"):
        rollout_scales(["a"], [1], mode="rollouts", n_mini_batches=0)
    with pytest.raises(ValueError, match="rollout 'b' has no trained token"):
        rollout_scales(["a", "b"], [1, 0], mode="rollouts", n_mini_batches=1)
    with pytest.raises(ValueError, match="2 rollout ids for 1 rows"):
        rollout_scales(["a", "b"], [1], mode="rollouts", n_mini_batches=1)


def test_config_key_defaults_to_rollouts_and_is_validated():
    assert load_config().agentlightning.loss_normalization == "rollouts"
    assert (
        load_config(overrides=["agentlightning.loss_normalization=upstream"]).agentlightning.loss_normalization
        == "upstream"
    )
    with pytest.raises(ConfigError, match="agentlightning.loss_normalization"):
        load_config(overrides=["agentlightning.loss_normalization=tokens"])
