"""Token-budget micro-batches: the grouping, its config keys (verl's), the tensors a micro-batch is cut
to, and a torch-backend update in micro-batches equal to the one-pass update."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from agl_core.backends.micro_batching import split
from agl_core.backends.torch.backend import load_policy
from agl_core.backends.torch.update import ActorSettings, ActorUpdate
from agl_core.config import ConfigError, load_config
from agl_core.data import CompletedRollout, TrainingRow, Triplet
from agl_core.plugins import PluginManager
from agl_core.stages.micro_batches import micro_batches, padded_elements
from agl_core.stages.pipeline import StepPipeline
from agl_core.stages.policy_loss import PolicyLossSpec
from agl_core.stages.tensorize import tensorize

lengths = st.lists(st.tuples(st.integers(1, 60), st.integers(1, 60)), min_size=1, max_size=40)


@given(rows=lengths, budget=st.integers(120, 600))
@settings(deadline=None)
def test_every_row_lands_in_exactly_one_group_within_the_budget(rows, budget):
    prompts, responses = [p for p, _ in rows], [r for _, r in rows]
    groups = micro_batches(prompts, responses, budget)
    assert sorted(i for group in groups for i in group) == list(range(len(rows)))
    for group in groups:
        assert group == sorted(group)
        assert len(group) * (max(prompts[i] for i in group) + max(responses[i] for i in group)) <= budget
    # a budget of the longest row's size or more never needs more groups than rows, nor one for two
    # rows that fit together: a single group when everything fits padded to the longest row
    if len(rows) * (max(prompts) + max(responses)) <= budget:
        assert len(groups) == 1


def multi_turn_lengths(n_rollouts: int, n_turns: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Transition rows of multi-turn rollouts: each turn's prompt is the last one plus its response and a
    new message; responses and messages of 50-600 tokens."""
    rng = np.random.default_rng(seed)
    prompts, responses = [], []
    for _ in range(n_rollouts):
        prompt = int(rng.integers(50, 600))
        for _ in range(n_turns):
            response = int(rng.integers(50, 600))
            prompts.append(prompt)
            responses.append(response)
            prompt += response + int(rng.integers(50, 600))
    return np.array(prompts), np.array(responses)


@pytest.mark.parametrize(
    "workload",
    [
        multi_turn_lengths(256, 8),  # transition rows: prompts grow with the turns
        (
            np.random.default_rng(1).integers(50, 600, 2048),
            np.random.default_rng(2).integers(50, 600, 2048),
        ),  # independent
    ],
    ids=["256x8-turns", "2048-independent"],
)
def test_padding_stays_small_on_varied_lengths(workload):
    prompts, responses = workload
    budget = max(16384, int((prompts + responses).max()))
    real = int(prompts.sum() + responses.sum())
    groups = micro_batches(prompts, responses, budget)
    assert padded_elements(prompts, responses, groups) / real <= 1.2
    # padded to the longest row, as one batch is, costs far more
    assert len(prompts) * (prompts.max() + responses.max()) / real > 1.5


def test_a_row_longer_than_the_budget_is_an_error_naming_the_key_not_dropped():
    assert micro_batches([], [], 10) == []
    assert micro_batches([3, 5], [7, 1], 24) == [[0, 1]]  # 2 × (5 + 7) = 24 fits
    assert micro_batches([3, 5], [7, 1], 23) == [[0], [1]]
    with pytest.raises(ValueError, match=r"row 1 has 12 tokens \(prompt \+ response\), more than some\.key = 10"):
        micro_batches([3, 6], [4, 6], 10, key="some.key")
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        micro_batches([3], [4], 0)
    with pytest.raises(ValueError, match="prompt lengths"):
        micro_batches([3], [4, 5], 10)


def test_a_micro_batch_is_cut_to_what_tensorizing_its_rows_gives():
    rng = np.random.default_rng(0)
    rows = [
        TrainingRow(
            prompt_ids=rng.integers(3, 100, int(rng.integers(2, 20))),
            response_ids=(response := rng.integers(3, 100, int(rng.integers(1, 20)))),
            response_mask=np.ones(len(response), np.int64),
            reward=float(i),
            rollout_id=f"r{i}",
            group_id="g",
            log_probs=-rng.random(len(response)).astype(np.float32),
        )
        for i in range(12)
    ]
    tensors = tensorize(rows, pad_token_id=0).tensors
    parts = split(tensors, 64, "budget.key")
    assert len(parts) > 2 and sorted(i for part in parts for i in part.rows.tolist()) == list(range(12))
    for part in parts:
        alone = tensorize(
            [rows[i] for i in part.rows.tolist()],
            pad_token_id=0,
            prompt_length=part.prompt_length,
            response_length=part.response_length,
        )
        cut = part.cut(tensors)
        assert cut.keys() == alone.tensors.keys()
        for name, value in alone.tensors.items():
            assert torch.equal(cut[name], value), name
        assert part.cut(tensors)["input_ids"].numel() <= 64


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (
            ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10239"],
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        ),
        (
            ["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=0"],
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        ),
        (["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=-1"], "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
        (
            [
                "agentlightning.trace_aggregator.level=transition",
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1023",
            ],
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        ),
        (["actor_rollout_ref.actor.use_dynamic_bsz=maybe"], "actor_rollout_ref.actor.use_dynamic_bsz"),
    ],
)
def test_a_bad_or_too_small_budget_names_its_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(overrides=overrides)


def test_a_budget_that_holds_the_longest_row_is_accepted():
    # trajectory limits 2048 + 8192; transition limits 512 + 512
    load_config(
        overrides=[
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10240",
        ]
    )
    load_config(
        overrides=[
            "agentlightning.trace_aggregator.level=transition",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
        ]
    )
    # a budget that is not used is not checked against the rows
    load_config(overrides=["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100"])


def test_the_total_length_cap_bounds_the_longest_row_below_the_trajectory_limits():
    capped = [
        "agentlightning.trace_aggregator.trajectory_max_total_length=4096",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
    ]
    load_config(overrides=[*capped, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"])
    with pytest.raises(ConfigError, match="less than the longest row.*trajectory_max_total_length = 4096"):
        load_config(overrides=[*capped, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4095"])
    with pytest.raises(ConfigError, match=r"data.max_prompt_length \+ data.max_response_length = 1024"):
        load_config(
            overrides=[
                *capped,
                "agentlightning.trace_aggregator.level=transition",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000",
            ]
        )


def test_the_log_prob_keys_follow_the_actor_unless_set_as_in_verl():
    default = load_config().actor_rollout_ref
    assert default.actor.use_dynamic_bsz is False and default.actor.ppo_max_token_len_per_gpu == 16384
    assert default.rollout.log_prob_use_dynamic_bsz is False and default.ref.log_prob_max_token_len_per_gpu == 16384
    cfg = load_config(
        overrides=[
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20000",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=30000",
        ]
    ).actor_rollout_ref
    assert cfg.rollout.log_prob_use_dynamic_bsz is True and cfg.rollout.log_prob_max_token_len_per_gpu == 20000
    assert cfg.ref.log_prob_use_dynamic_bsz is True and cfg.ref.log_prob_max_token_len_per_gpu == 30000
    assert ActorSettings.from_config(cfg) == attrs.evolve(
        ActorSettings.from_config(default),
        update_max_tokens=20000,
        old_log_prob_max_tokens=20000,
        ref_log_prob_max_tokens=30000,
    )


@pytest.mark.verl
def test_the_verl_backend_hands_verl_the_same_keys_unchanged():
    verl_config = pytest.importorskip("agl_backend_verl.config")
    overrides = [
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20000",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30000",
    ]
    cfg = verl_config.load_verl_config(overrides=overrides)
    OmegaConf.resolve(cfg)  # as the verl backend's task runner does before verl reads it
    section = cfg.actor_rollout_ref
    assert section.actor.use_dynamic_bsz is True and section.actor.ppo_max_token_len_per_gpu == 20000
    assert section.rollout.log_prob_use_dynamic_bsz is True and section.rollout.log_prob_max_token_len_per_gpu == 30000
    assert section.ref.log_prob_use_dynamic_bsz is True and section.ref.log_prob_max_token_len_per_gpu == 20000
    default = verl_config.load_verl_config()
    OmegaConf.resolve(default)
    assert (
        default.actor_rollout_ref.actor.use_dynamic_bsz is False
        and default.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu == 16384
    )
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.ppo_max_token_len_per_gpu"):
        verl_config.load_verl_config(
            overrides=[
                "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000",
            ]
        )


# -- the update in micro-batches equals the one-pass update ---------------------------------------

BUDGET = 64  # the limits below are 24 + 40 tokens, so a micro-batch holds 1-4 rows


def rollouts() -> list[CompletedRollout]:
    """Two groups of four rollouts of varied lengths; rollouts 0 and 5 make two calls that do not continue
    each other (two rows each), so a rollout's rows may fall in different micro-batches."""
    rng = np.random.default_rng(0)
    out = []
    for k in range(8):
        calls = 2 if k in (0, 5) else 1
        triplets = [
            Triplet(
                prompt_ids=rng.integers(3, 1000, int(rng.integers(3, 24))),
                response_ids=rng.integers(3, 1000, int(rng.integers(2, 40))),
            )
            for _ in range(calls)
        ]
        out.append(
            CompletedRollout(
                rollout_id=f"r{k}",
                group_id=f"g{k // 4}",
                state="succeeded",
                triplets=triplets,
                final_reward=float(k % 3) + 0.1 * k,
            )
        )
    return out


def one_update(model_dir, loss: str, normalization: str, *extra: str):
    """One ActorUpdate (plain SGD, so equal steps mean equal gradients) from the tiny model's weights: the
    weights after it and its metrics."""
    cfg = load_config(
        overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            "agentlightning.trace_aggregator.level=trajectory",
            "agentlightning.trace_aggregator.trajectory_max_prompt_length=24",
            "agentlightning.trace_aggregator.trajectory_max_response_length=40",
            f"agentlightning.loss_normalization={normalization}",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # 4 + some rows a mini-batch: 2 optimizer steps
            "actor_rollout_ref.actor.ppo_epochs=2",
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}",
            "actor_rollout_ref.actor.entropy_coeff=0.1",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.5",
            *extra,
        ]
    )
    plugins = PluginManager(load_entrypoints=False)
    torch.manual_seed(0)
    model, ref = load_policy(model_dir, torch.device("cpu")), load_policy(model_dir, torch.device("cpu"), frozen=True)
    with torch.no_grad():  # the reference differs from the policy, so the KL term has a gradient
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn = plugins.policy_losses.get(loss)
    update = ActorUpdate(
        model, ref, optimizer, loss_fn, ActorSettings.from_config(cfg.actor_rollout_ref), torch.device("cpu"), 0
    )
    prepared = StepPipeline(cfg, plugins).prepare(rollouts(), step=1)
    assert prepared.shaped.n_mini_batches == 2
    metrics = update(prepared)
    return {k: v.detach().clone() for k, v in model.named_parameters()}, metrics


@pytest.mark.parametrize("loss", ["per_rollout_mean", "token_mean"])
@pytest.mark.parametrize("normalization", ["rollouts", "upstream"])
def test_the_update_in_micro_batches_equals_the_one_pass_update(tiny_model_dir, loss, normalization):
    before = {k: v.detach() for k, v in load_policy(tiny_model_dir, torch.device("cpu")).named_parameters()}
    single, single_metrics = one_update(tiny_model_dir, loss, normalization)
    micro, micro_metrics = one_update(
        tiny_model_dir,
        loss,
        normalization,
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={BUDGET}",
    )
    assert single_metrics["actor/n_updates"] == micro_metrics["actor/n_updates"] == 4.0  # 2 epochs × 2 mini-batches
    assert single_metrics["actor/n_micro_batches"] == 4.0 and micro_metrics["actor/n_micro_batches"] >= 12.0
    assert micro_metrics["perf/padded_per_real_tokens"] < single_metrics["perf/padded_per_real_tokens"]
    change = max(float((single[k] - before[k]).abs().max()) for k in before)
    assert change > 1e-4, "the update moved the weights"
    for name, value in single.items():
        torch.testing.assert_close(micro[name] - before[name], value - before[name], rtol=1e-4, atol=1e-4 * change)
    names = [
        "actor/pg_loss",
        "actor/entropy_loss",
        "actor/kl_loss",
        "actor/loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
        "actor/grad_norm",
    ]
    for name in names:
        assert micro_metrics[name] == pytest.approx(single_metrics[name], rel=1e-4, abs=1e-6), name
    assert single_metrics["actor/pg_clipfrac"] > 0, "the second epoch's ratios clip, so the old log-probs matter"


def test_a_loss_that_does_not_add_up_over_micro_batches_is_refused_with_them(tiny_model_dir):
    cfg = load_config(overrides=["actor_rollout_ref.actor.use_dynamic_bsz=true"])
    settings = ActorSettings.from_config(cfg.actor_rollout_ref)
    loss = PolicyLossSpec(
        PluginManager(load_entrypoints=False).policy_losses.get("token_mean"), additive_over_micro_batches=False
    )
    model = load_policy(tiny_model_dir, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.use_dynamic_bsz"):
        ActorUpdate(model, None, torch.optim.SGD(model.parameters(), lr=0.1), loss, settings, torch.device("cpu"), 0)
    ActorUpdate(
        model,
        None,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss,
        attrs.evolve(settings, update_max_tokens=None),
        torch.device("cpu"),
        0,
    )
