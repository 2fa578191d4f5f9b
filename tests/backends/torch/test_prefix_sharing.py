"""Prefix sharing: the layout computes each shared token once, and the torch backend's log-probs,
entropy, loss and gradients through it equal the unshared computation within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl_core.backends.micro_batching import UpdateBatch
from agl_core.backends.ppo import response_stats
from agl_core.backends.torch.backend import load_policy
from agl_core.backends.torch.checks import check_positions, forward_takes_position_ids, position_problem
from agl_core.backends.torch.prefix_packing import check_packable, pack_cost, split_shared
from agl_core.backends.torch.update import ActorSettings, ActorUpdate
from agl_core.config import ConfigError, load_config
from agl_core.data import TrainingRow
from agl_core.plugins import PluginManager
from agl_core.stages.prefix_sharing import PackCost, prefix_packs
from agl_core.stages.tensorize import tensorize
from tests.helpers.actor_updates import applied_gradients
from tests.helpers.training_rows import row_sequences, training_rows

# float32 tolerances of the shared against the unshared computation (measured over 40 examples of this
# strategy: log-probs differ by at most 8.6e-6, entropy by 4.9e-6, gradients by 3.8e-6 of their largest entry)
LOG_PROB_ATOL = 5e-5
GRAD_RTOL = 1e-4
METRIC_RTOL = 1e-4


def unique_prefixes(sequences: list[np.ndarray]) -> int:
    """The nodes of the sequences' prefix tree: each distinct prefix once."""
    return len({tuple(s[: n + 1]) for s in sequences for n in range(len(s))})


@given(
    sequences=row_sequences(max_length=60),  # within the cap of 60 drawn below
    per_pair=st.sampled_from([0.0, 1.0, 1000.0]),
    cap=st.sampled_from([None, 60]),
    tree_cap=st.sampled_from([None, 30]),
)
@settings(deadline=None, max_examples=200)
def test_every_row_reads_its_own_tokens_positions_and_ancestors_from_its_pack(sequences, per_pair, cap, tree_cap):
    layout = prefix_packs(
        sequences, PackCost(per_token=100.0, per_pair=per_pair), max_length=cap, max_tree_length=tree_cap
    )
    assert sorted(int(r) for p in layout.packs for r in p.rows) == list(range(len(sequences)))
    for row, tokens in enumerate(sequences):
        pack = layout.packs[layout.row_pack[row]]
        path = layout.row_paths[row]
        assert row in pack.rows
        np.testing.assert_array_equal(pack.tokens[path], tokens)
        np.testing.assert_array_equal(pack.positions[path], np.arange(len(tokens)))
        for t, q in enumerate(path.tolist()):  # the token at t attends exactly to the row's tokens up to t
            keys = np.arange(len(pack))
            attended = keys <= q if pack.is_chain else (keys <= q) & (q < pack.subtree_end)
            assert set(np.flatnonzero(attended).tolist()) == set(path[: t + 1].tolist())
    assert all(cap is None or len(p) <= cap for p in layout.packs)
    assert all(tree_cap is None or p.is_chain or len(p) <= tree_cap for p in layout.packs)
    if per_pair == 0 and cap is None and tree_cap is None:  # attention free: every shared token is shared
        assert layout.n_tokens == unique_prefixes(sequences)


def test_a_chain_of_transition_rows_is_computed_as_its_last_row():
    turns = np.arange(3, 3 + 400)
    rows = [turns[:n] for n in (50, 120, 260, 400)]
    layout = prefix_packs(rows[::-1], PackCost(per_token=1000.0, per_pair=1.0))
    assert len(layout.packs) == 1 and layout.packs[0].is_chain and layout.n_tokens == 400


def test_a_group_prompt_is_shared_only_when_it_pays_for_the_mask():
    prompt, rng = np.arange(3, 503), np.random.default_rng(0)
    rows = [np.concatenate([prompt, rng.integers(3, 1000, 20)]) for _ in range(4)]
    cheap_attention = prefix_packs(rows, PackCost(per_token=1e6, per_pair=1.0))
    assert len(cheap_attention.packs) == 1 and not cheap_attention.packs[0].is_chain
    assert cheap_attention.n_tokens == 500 + 4 * 20
    costly_attention = prefix_packs(rows, PackCost(per_token=1.0, per_pair=1.0))
    assert len(costly_attention.packs) == 4 and costly_attention.n_tokens == 4 * 520


def test_bad_rows_are_errors_naming_the_row():
    with pytest.raises(ValueError, match="row 1 has no tokens"):
        prefix_packs([np.array([1, 2]), np.array([], np.int64)], PackCost(1.0, 1.0))
    with pytest.raises(ValueError, match="row 0 has 5 tokens, more than a pack may hold"):
        prefix_packs([np.arange(5)], PackCost(1.0, 1.0), max_length=4)


# -- the model computation ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_policy(tiny_model_dir, torch.device("cpu"))


def shared_log_probs_and_entropy(model, tensors, budget, cost):
    log_probs, entropy = torch.zeros(tensors["responses"].shape), torch.zeros(tensors["responses"].shape)
    for micro in split_shared(tensors, budget, "budget", cost):
        stats = response_stats(model, micro.cut(tensors), micro.packed)
        log_probs[micro.rows, : micro.response_length] = stats.log_prob
        entropy[micro.rows, : micro.response_length] = stats.entropy
    return log_probs, entropy


def actor_update(model, share: bool, budget: int | None) -> ActorUpdate:
    overrides = [
        "actor_rollout_ref.actor.entropy_coeff=0.1",
        "actor_rollout_ref.actor.grad_clip=1e9",
        "agentlightning.trace_aggregator.trajectory_max_prompt_length=60",
        "agentlightning.trace_aggregator.trajectory_max_response_length=60",
    ]
    if budget is not None:
        overrides += [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        ]
    cfg = load_config(overrides=overrides)
    loss = PluginManager(load_entrypoints=False).policy_losses.get("per_rollout_mean")
    settings = ActorSettings.from_config(cfg.actor_rollout_ref, share_prefixes=share)
    return ActorUpdate(model, None, torch.optim.SGD(model.parameters(), lr=1.0), loss, settings, torch.device("cpu"), 0)


@given(rows=training_rows(), budget=st.sampled_from([None, 128]), per_pair=st.sampled_from([0.0, 1024.0]))
@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_shared_log_probs_entropy_loss_and_gradients_equal_the_unshared_ones(model, rows, budget, per_pair):
    tensors = tensorize(rows).tensors
    cost = PackCost(pack_cost(model).per_token, per_pair)  # 0: share every prefix, with tree masks
    responses = tensors["attention_mask"][:, tensors["prompts"].shape[1] :].bool()
    with torch.no_grad():
        stats = response_stats(model, tensors)
        log_probs = stats.log_prob
        shared_log_probs, shared_entropy = shared_log_probs_and_entropy(model, tensors, budget, cost)
    torch.testing.assert_close(shared_log_probs[responses], log_probs[responses], rtol=0, atol=LOG_PROB_ATOL)
    torch.testing.assert_close(shared_entropy[responses], stats.entropy[responses], rtol=0, atol=LOG_PROB_ATOL)

    advantages = torch.as_tensor(np.random.default_rng(len(rows)).normal(size=log_probs.shape), dtype=torch.float32)
    batch = UpdateBatch(tensors, advantages * tensors["response_mask"], log_probs - 0.05, None)
    plain = actor_update(model, share=False, budget=budget)
    shared = actor_update(model, share=True, budget=budget)
    shared.pack_cost = cost
    plain_grads, plain_metrics = applied_gradients(plain, batch)
    shared_grads, shared_metrics = applied_gradients(shared, batch)
    scale = max(float(g.abs().max()) for g in plain_grads.values())
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=GRAD_RTOL, atol=GRAD_RTOL * scale)
    # The losses are sums of signed per-token terms: their rounding grows with the terms' size, not with
    # the sum's (which may cancel to near 0), so they are compared relative to the same sum over |A|.
    magnitude_batch = UpdateBatch(tensors, advantages.abs() * tensors["response_mask"], log_probs - 0.05, None)
    _, magnitude = applied_gradients(plain, magnitude_batch)
    loss_atol = METRIC_RTOL * (abs(magnitude["actor/pg_loss"]) + abs(plain_metrics["actor/entropy_loss"]))
    for name in ("actor/pg_loss", "actor/loss"):
        assert shared_metrics[name] == pytest.approx(plain_metrics[name], rel=METRIC_RTOL, abs=loss_atol), name
    for name in ("actor/entropy_loss", "actor/pg_clipfrac", "actor/grad_norm"):
        assert shared_metrics[name] == pytest.approx(plain_metrics[name], rel=METRIC_RTOL, abs=1e-6), name
    assert shared_metrics["perf/n_real_tokens"] <= plain_metrics["perf/n_real_tokens"]


def test_the_update_reports_what_sharing_saved(model):
    turns = np.arange(3, 3 + 90)
    rows = [
        TrainingRow(
            prompt_ids=turns[:p],
            response_ids=turns[p : p + 20],
            response_mask=np.ones(20),
            reward=1.0,
            rollout_id="r",
            group_id="g",
        )
        for p in (10, 40, 70)
    ]
    tensors = tensorize(rows).tensors
    advantages = torch.ones(tensors["responses"].shape) * tensors["response_mask"]
    metrics = actor_update(model, share=True, budget=None).mini_batch_step(
        UpdateBatch(tensors, advantages, torch.zeros(advantages.shape), None)
    )
    assert metrics["perf/n_real_tokens"] == 90 and metrics["perf/n_row_tokens"] == 30 + 60 + 90
    assert metrics["perf/n_padded_tokens"] == 90 and metrics["actor/n_micro_batches"] == 1


@pytest.mark.parametrize(
    "setting",
    [
        {"_attn_implementation": "flash_attention_2"},
        {"sliding_window": 16, "use_sliding_window": True},
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
    ],
    ids=["attention", "sliding-window", "batch-dependent-rope"],
)
def test_a_model_the_mask_does_not_describe_is_refused_naming_the_key(model, setting):
    check_packable(model)
    before = {name: getattr(model.config, name) for name in setting}
    for name, value in setting.items():
        setattr(model.config, name, value)
    try:
        with pytest.raises(ConfigError, match=r"agentlightning\.torch\.share_prefixes"):
            check_packable(model)
    finally:
        for name, value in before.items():
            setattr(model.config, name, value)


# -- which models a pack computes: decided by what they compute -------------------------------------

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
TINY_HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
FAMILIES = {  # model type -> config settings beyond the tiny sizes
    "qwen3": {},
    "mistral": {"sliding_window": None},
    "gemma": {},
    "phi3": {"pad_token_id": 0},
    "llama": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
}
REFUSED = {  # model type -> (settings, what the refusal says)
    "llama": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "'dynamic'"),
    "mistral": ({"sliding_window": 8}, "sliding-window"),
}


def tiny_family(model_type: str, settings: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **TINY, **TINY_HEADS, **settings)
    config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def branching_rows() -> list[TrainingRow]:
    """Three rows of one prompt whose responses branch: their pack is a tree."""
    prompt = list(range(3, 15))
    return [
        TrainingRow(
            prompt_ids=prompt,
            response_ids=response,
            response_mask=[1] * len(response),
            reward=0.0,
            rollout_id=f"r{i}",
            group_id="g",
        )
        for i, response in enumerate([[20, 21, 22, 23], [20, 21, 30], [40, 41, 42, 43, 44]])
    ]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_model_whose_positions_a_pack_computes_is_accepted_and_exact(model_type, tmp_path):
    model = tiny_family(model_type, FAMILIES[model_type])
    check_packable(model)
    model.config.to_json_file(tmp_path / "config.json")
    check_positions(tmp_path)  # agl check's verdict, from config.json and the modeling source
    tensors = tensorize(branching_rows()).tensors
    responses = tensors["attention_mask"][:, tensors["prompts"].shape[1] :].bool()
    with torch.no_grad():
        padded = response_stats(model, tensors).log_prob
        (micro,) = split_shared(tensors, None, "budget", PackCost(1.0, 0.0))
        assert micro.packed.attention_mask is not None, "the rows form a tree pass"
        shared, _ = shared_log_probs_and_entropy(model, tensors, None, PackCost(1.0, 0.0))
    torch.testing.assert_close(shared[responses], padded[responses], rtol=0, atol=LOG_PROB_ATOL)


@pytest.mark.parametrize("model_type", REFUSED)
def test_a_model_whose_positions_a_pack_changes_is_refused_by_agl_check_and_agl_train(model_type, tmp_path):
    settings, reason = REFUSED[model_type]
    model = tiny_family(model_type, settings)
    model.config.to_json_file(tmp_path / "config.json")
    for check in (lambda: check_packable(model), lambda: check_positions(tmp_path)):
        with pytest.raises(ConfigError, match=rf"{reason}.*agentlightning\.torch\.share_prefixes=false"):
            check()


def test_a_model_whose_forward_takes_no_position_ids_is_refused():
    from transformers import BloomConfig

    config = {**BloomConfig().to_dict(), "architectures": ["BloomForCausalLM"]}
    assert not forward_takes_position_ids(config)
    assert "takes no position_ids" in position_problem(config, forward_takes_position_ids(config))
