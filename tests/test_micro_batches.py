"""Token-budget micro-batches: the grouping itself, its config keys, and an update equal to a single pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_core.config import ConfigError, load_config
from agl_core.data import CompletedRollout, Triplet
from agl_core.plugins import PluginManager
from agl_core.stages.micro_batches import micro_batches, padded_elements
from agl_core.backends.torch.backend import TorchBackend
from tests.corridor_policy import build_corridor_policy

lengths = st.lists(st.tuples(st.integers(1, 60), st.integers(1, 60)), min_size=1, max_size=40)


@given(rows=lengths, budget=st.integers(120, 600))
@settings(deadline=None)
def test_every_row_lands_in_one_group_within_the_budget(rows, budget):
    prompts, responses = [p for p, _ in rows], [r for _, r in rows]
    groups = micro_batches(prompts, responses, budget)
    assert sorted(i for g in groups for i in g.rows) == list(range(len(rows)))
    for g in groups:
        assert list(g.rows) == sorted(g.rows)
        assert g.prompt_length == max(prompts[i] for i in g.rows)
        assert g.response_length == max(responses[i] for i in g.rows)
        assert g.padded_elements <= budget


def test_no_budget_is_one_group_and_bad_budgets_are_refused():
    (group,) = micro_batches([3, 5], [7, 1], None)
    assert group.rows == (0, 1) and (group.prompt_length, group.response_length) == (5, 7)
    assert micro_batches([], [], 10) == []
    with pytest.raises(ValueError, match="row 1 has 12 tokens, more than the micro-batch budget of 10"):
        micro_batches([3, 6], [4, 6], 10)
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        micro_batches([3], [4], 0)
    with pytest.raises(ValueError, match="prompt lengths"):
        micro_batches([3], [4, 5], 10)


def test_similar_lengths_share_a_group_so_padding_stays_small():
    rng = np.random.default_rng(0)
    prompts = rng.integers(50, 3000, size=512)
    responses = rng.integers(150, 350, size=512)
    groups = micro_batches(prompts, responses, 16384)
    assert padded_elements(groups) / int(prompts.sum() + responses.sum()) < 1.2
    # Padding everything to the longest row, as one batch does, wastes far more.
    assert 512 * (prompts.max() + responses.max()) / int(prompts.sum() + responses.sum()) > 1.5


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000"], "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
        (["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=0"], "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
        (
            ["agentlightning.trace_aggregator.level=transition", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1023"],
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        ),
    ],
)
def test_a_budget_below_the_longest_row_names_its_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(overrides=overrides)


def test_the_log_prob_keys_follow_the_actor_unless_set_as_in_verl():
    cfg = load_config(overrides=["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20000"])
    for section in (cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref):
        assert section.log_prob_use_dynamic_bsz is True and section.log_prob_max_token_len_per_gpu == 20000
    default = load_config()
    assert default.actor_rollout_ref.actor.use_dynamic_bsz is False
    assert default.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 16384


@pytest.mark.verl
def test_the_verl_backend_hands_verl_the_same_keys():
    verl_config = pytest.importorskip("agl_backend_verl.config")
    cfg = verl_config.load_verl_config(
        overrides=[
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20000",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30000",
        ]
    )
    actor_rollout_ref = cfg.actor_rollout_ref
    assert actor_rollout_ref.actor.use_dynamic_bsz is True and actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 20000
    assert actor_rollout_ref.rollout.log_prob_use_dynamic_bsz is True
    assert actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 30000
    assert actor_rollout_ref.ref.log_prob_use_dynamic_bsz is True and actor_rollout_ref.ref.log_prob_max_token_len_per_gpu == 20000


# -- the update equals a single pass -------------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_corridor_policy(tmp_path_factory.mktemp("policy"))


def _rollouts(vocab: int) -> list[CompletedRollout]:
    """16 rollouts in 4 groups, 2-3 prefix-continuing calls each, of varied lengths and rewards."""
    rng = np.random.default_rng(1)
    out = []
    for r in range(16):
        prompt = rng.integers(0, vocab, size=int(rng.integers(4, 24)))
        calls = []
        for _ in range(int(rng.integers(2, 4))):
            response = rng.integers(0, vocab, size=int(rng.integers(3, 14)))
            calls.append(Triplet(prompt_ids=prompt, response_ids=response, response_log_probs=-rng.random(len(response)).astype(np.float32)))
            prompt = np.concatenate([prompt, response, rng.integers(0, vocab, size=int(rng.integers(1, 5)))])
        out.append(CompletedRollout(rollout_id=f"r{r}", group_id=f"g{r // 4}", state="succeeded", triplets=calls, final_reward=float(rng.random())))
    return out


def _updated(policy, tmp_path, loss, normalization, *extra):
    config = load_config(
        "examples/corridor/config.yaml",
        [
            f"actor_rollout_ref.model.path={policy}",
            f"trainer.default_local_dir={tmp_path}",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # 8 rows a mini-batch: 2 optimizer steps
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}",
            f"agentlightning.loss_normalization={normalization}",
            "agentlightning.trace_aggregator.trajectory_max_prompt_length=64",
            "agentlightning.trace_aggregator.trajectory_max_response_length=64",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.1",
            *extra,
        ],
    )
    backend = TorchBackend(config, PluginManager.from_config(config, (), load_entrypoints=False))
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    # The reference policy differs from the policy, so the KL term has a gradient.
    with torch.no_grad():
        for p in backend.ref_model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    # Plain SGD makes each step's parameter change the clipped gradient itself, so equal updates
    # mean equal gradients (AdamW divides by the gradient's own size and magnifies rounding noise).
    backend.optimizer = torch.optim.SGD(backend.model.parameters(), lr=0.1)
    prepared = backend.pipeline.prepare(_rollouts(backend.model.config.vocab_size), step=1)
    metrics = backend.update(prepared)
    return before, backend.model.state_dict(), metrics


@pytest.mark.parametrize("loss", ["per_rollout_mean", "token_mean"])
@pytest.mark.parametrize("normalization", ["rollouts", "upstream"])
def test_micro_batched_update_equals_the_single_pass(policy, tmp_path, loss, normalization):
    torch.manual_seed(0)
    before, single, single_metrics = _updated(policy, tmp_path, loss, normalization)
    torch.manual_seed(0)
    _, micro, micro_metrics = _updated(
        policy,
        tmp_path,
        loss,
        normalization,
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128",
    )
    assert single_metrics["actor/n_micro_batches"] == 1.0 and single_metrics["actor/n_updates"] == 2.0
    assert micro_metrics["actor/n_micro_batches"] > 2.0  # per optimizer step, on average
    assert any(not torch.equal(single[k], before[k]) for k in before)  # the update did something
    for name, value in single.items():
        torch.testing.assert_close(micro[name] - before[name], value - before[name], rtol=1e-4, atol=1e-7)
    for name in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"):
        assert micro_metrics[name] == pytest.approx(single_metrics[name], rel=1e-4, abs=1e-6), name
    assert micro_metrics["perf/padded_per_real_tokens"] < single_metrics["perf/padded_per_real_tokens"]
