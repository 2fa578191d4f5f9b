"""verl-native estimators through the backend's rollout-level path equal verl's own, and broadcast."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.verl

pytest.importorskip("verl")

from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402

from agl_backend_verl.advantages import compute_advantages, is_verl_estimator  # noqa: E402
from agl_backend_verl.config import load_verl_config, verl_algorithm_config  # noqa: E402
from agl_backend_verl.dataproto import to_dataproto  # noqa: E402
from agl_core.data import TrainingRow  # noqa: E402
from agl_core.plugins import PluginManager  # noqa: E402
from agl_core.stages.tensorize import tensorize  # noqa: E402

VERL_ESTIMATORS = ["grpo", "rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus", "opo"]


def config(estimator: str, *extra: str):
    return load_verl_config(None, [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=4", *extra])


def rows_of(rollouts_rows: list[int], seed: int) -> list[TrainingRow]:
    """Groups of 4 rollouts; rollout k has ``rollouts_rows[k]`` rows of random lengths and one reward."""
    rng = np.random.default_rng(seed)
    rows = []
    for k, n_rows in enumerate(rollouts_rows):
        reward = float(rng.integers(0, 5)) / 4
        for j in range(n_rows):
            n = int(rng.integers(1, 9))
            mask = rng.integers(0, 2, n)
            mask[rng.integers(0, n)] = 1
            rows.append(
                TrainingRow(
                    prompt_ids=rng.integers(1, 100, int(rng.integers(1, 6))),
                    response_ids=rng.integers(1, 100, n),
                    response_mask=mask,
                    reward=reward,
                    rollout_id=f"r{k}",
                    group_id=f"g{k // 4}",
                    turn_index=j,
                )
            )
    return rows


def verl_direct(rows, cfg):
    """verl's own compute_advantage over the rows as verl's trainer would run it (one row, one sample)."""
    data = to_dataproto(tensorize(rows))
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    algorithm = cfg.algorithm
    out = compute_advantage(
        data,
        adv_estimator=algorithm.adv_estimator,
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        num_repeat=4,
        norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
        config=verl_algorithm_config(cfg),
    )
    mask = out.batch["response_mask"].bool()
    return [
        out.batch["advantages"][i][: len(row.response_ids)].numpy() * mask[i][: len(row.response_ids)].numpy()
        for i, row in enumerate(rows)
    ]


@pytest.mark.parametrize("estimator", VERL_ESTIMATORS)
@pytest.mark.parametrize("seed", [0, 1])
def test_single_row_rollouts_equal_verls_own(estimator, seed):
    cfg = config(estimator)
    rows = rows_of([1] * 12, seed)
    assert is_verl_estimator(estimator)
    ours = compute_advantages(rows, cfg, PluginManager(load_entrypoints=False))
    expected = verl_direct(rows, cfg)
    for got, want in zip(ours.per_row, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert any(np.any(a) for a in ours.per_row)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_multi_row_rollouts_get_their_representatives_value_on_every_trained_token(estimator):
    cfg = config(estimator)
    counts = [1, 3, 2, 1, 2, 1, 1, 3]
    rows = rows_of(counts, 5)
    ours = compute_advantages(rows, cfg, PluginManager(load_entrypoints=False))
    firsts = {}
    for row in rows:
        firsts.setdefault(row.rollout_id, row)
    representatives = list(firsts.values())
    per_rollout = {
        rep.rollout_id: adv[rep.response_mask.astype(bool)][0]
        for rep, adv in zip(representatives, verl_direct(representatives, cfg))
    }
    for row, adv in zip(rows, ours.per_row):
        np.testing.assert_allclose(adv[row.response_mask == 1], per_rollout[row.rollout_id], rtol=1e-6)
        assert not adv[row.response_mask == 0].any()
    assert ours.metrics["training/rollout_level_advantage/n_multi_row_rollouts"] == 4
    assert ours.metrics["training/rollout_level_advantage/max_rows_per_rollout"] == 3
    # a per-row computation (verl's own trainer) would count each extra row as another sample
    per_row_verl = verl_direct(rows, cfg)
    assert not all(np.allclose(a, b) for a, b in zip(ours.per_row, per_row_verl))


def test_marked_rows_still_count_for_their_group():
    import attrs

    cfg = config("grpo")
    rows = rows_of([1] * 4, 2)
    marked = [attrs.evolve(rows[0], dropped=True), *rows[1:]]
    np.testing.assert_allclose(
        np.concatenate(compute_advantages(marked, cfg, PluginManager(load_entrypoints=False)).per_row),
        np.concatenate(compute_advantages(rows, cfg, PluginManager(load_entrypoints=False)).per_row),
    )


def test_agl_estimators_are_used_for_names_verl_lacks():
    cfg = config("reinforce")
    rows = rows_of([2, 1, 1, 1], 3)
    assert not is_verl_estimator("reinforce")
    ours = compute_advantages(rows, cfg, PluginManager(load_entrypoints=False))
    for row, adv in zip(rows, ours.per_row):
        np.testing.assert_allclose(adv, row.response_mask * row.reward)


def test_rows_are_samples_when_rollout_level_is_off():
    cfg = config("grpo", "algorithm.enable_rollout_level_advantage=false")
    rows = rows_of([2, 1, 3, 2], 4)
    ours = compute_advantages(rows, cfg, PluginManager(load_entrypoints=False))
    for got, want in zip(ours.per_row, verl_direct(rows, cfg)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_rollout_whose_rows_disagree_on_reward_is_refused():
    import attrs

    from agl_core.data import DataValidationError

    cfg = config("grpo")
    rows = rows_of([2, 1, 1, 1], 6)
    rows[1] = attrs.evolve(rows[1], reward=rows[0].reward + 1)
    with pytest.raises(DataValidationError, match="disagree on reward"):
        compute_advantages(rows, cfg, PluginManager(load_entrypoints=False))
    with pytest.raises(RuntimeError, match="disagree on reward"):  # as Agent Lightning v1.0 raised it
        compute_advantages(rows, cfg, PluginManager(load_entrypoints=False))


def test_returns_are_broadcast_per_rollout_like_advantages():
    """reinforce_plus_plus (gamma 1) returns each token's reward-to-go, the rollout's reward, and
    whitens them into advantages: both are one value per rollout on every row's trained tokens."""
    cfg = config("reinforce_plus_plus")
    rows = rows_of([1, 3, 2, 1, 2, 1, 1, 3], 5)
    ours = compute_advantages(rows, cfg, PluginManager(load_entrypoints=False))
    for row, returns, advantages in zip(rows, ours.returns, ours.per_row):
        trained = row.response_mask == 1
        np.testing.assert_allclose(returns[trained], row.reward, rtol=1e-6)
        assert not returns[~trained].any() and np.unique(advantages[trained]).size == 1
    assert not all(np.allclose(r, a) for r, a in zip(ours.returns, ours.per_row))


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        (["algorithm.gamma=0.5"], "advantages", "different advantages on different tokens"),
        ([], "response_mask", "no trained token"),
    ],
)
def test_rollouts_that_cannot_get_one_value_are_refused_by_name(overrides, field, message):
    import attrs

    from agl_core.data import DataValidationError

    cfg = config("reinforce_plus_plus", *overrides)
    rows = [attrs.evolve(row, response_ids=[7, 8, 9], response_mask=[1, 1, 1]) for row in rows_of([1] * 4, 2)]
    if not overrides:
        rows[2] = attrs.evolve(rows[2], response_mask=[0, 0, 0])
    with pytest.raises(RuntimeError, match=message) as err:
        compute_advantages(rows, cfg, PluginManager(load_entrypoints=False))
    assert isinstance(err.value, DataValidationError) and err.value.field == field
    assert err.value.rollout_id == ("r0" if overrides else "r2")
