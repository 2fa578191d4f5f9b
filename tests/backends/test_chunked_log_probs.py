"""The chunked log-probs and entropy (:func:`agl_core.backends.ppo.response_stats`) against the
log-softmax of the model's full logits, computed here as the update computed it before it was
chunked: values and gradients with respect to every trained parameter, for padded rows and for
prefix-shared packs, with tied and untied embeddings and a LoRA adapter on the output head, with a
chunk of 3 positions so that every pass runs several chunks.

Tolerances: in float64 the two differ by rounding only (measured: at most 9e-16 in the values, 8e-16
of the largest gradient entry), so values are compared to 1e-10 and gradients to 1e-10 of their
largest entry. Under bfloat16 autocast (around the pass, or inside the model's forward only, as
accelerate puts it) both take float32 softmaxes of the same bfloat16 logits
(measured: identical values, compared to 1e-6); the head's weight gradient is a bfloat16 product per
chunk summed in float32 against one bfloat16 product over every position (measured: 0.5% of the
largest entry, one bfloat16 rounding), compared to 2⁻⁶ of the largest entry.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agl_core.backends import ppo
from agl_core.backends.torch.prefix_packing import split_shared
from agl_core.config import ConfigError
from agl_core.data import TrainingRow
from agl_core.stages.prefix_sharing import PackCost
from agl_core.stages.tensorize import tensorize

VOCAB = 61
FLOAT64 = {"atol": 1e-10, "grad_rtol": 1e-10}
AUTOCAST = {"atol": 1e-6, "grad_rtol": 2**-6}
PROMPT = [5, 9, 14, 3, 22]


@pytest.fixture(autouse=True)
def three_positions_per_chunk(monkeypatch):
    monkeypatch.setattr(ppo, "CHUNK_BYTES", 3 * 4 * VOCAB)


def tiny_llama(tied: bool, dtype: torch.dtype = torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(dtype)


def with_lora_head(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    return get_peft_model(model, config)


def batch() -> dict:
    """A GRPO group's rows (one prompt, responses that branch and repeat) and an unrelated row."""
    responses = [[7, 8, 9, 10, 11], [7, 8, 30, 31], [7, 8, 9, 10, 11], [40], [12, 13, 14, 15, 16, 17, 18]]
    prompts = [PROMPT] * 4 + [[50, 51]]
    rows = [
        TrainingRow(
            prompt_ids=np.array(p),
            response_ids=np.array(r),
            response_mask=np.ones(len(r), np.int64),
            reward=1.0,
            rollout_id=f"r{i}",
            group_id="g",
        )
        for i, (p, r) in enumerate(zip(prompts, responses))
    ]
    return tensorize(rows).tensors


def reference_padded(model, tensors) -> ppo.ResponseStats:
    """The log-softmax over every padded response position, ``[rows, response_len, vocab]``."""
    width = tensors["responses"].shape[1]
    logits = model(**ppo.model_inputs(tensors), use_cache=False, logits_to_keep=width + 1).logits[:, :-1]
    log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    return stats_of(log_probs, tensors["responses"][..., None])


def reference_packed(model, packed, responses) -> ppo.ResponseStats:
    """The log-softmax over every kept column of the packs, read through ``packed.index``."""
    logits = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        position_ids=packed.position_ids,
        use_cache=False,
        logits_to_keep=packed.keep,
    ).logits
    log_probs = torch.log_softmax(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)), -1)
    return stats_of(log_probs[packed.index], responses[..., None])


def stats_of(log_probs: torch.Tensor, tokens: torch.Tensor) -> ppo.ResponseStats:
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return ppo.ResponseStats(log_prob=log_probs.gather(-1, tokens).squeeze(-1), entropy=entropy)


def gradients(model, compute) -> tuple[ppo.ResponseStats, dict[str, torch.Tensor]]:
    """``compute()``'s stats, and the gradient of a weighted sum of both over the trained parameters."""
    model.zero_grad(set_to_none=True)
    stats = compute()
    weights = torch.linspace(-1.0, 2.0, stats.log_prob.numel(), dtype=stats.log_prob.dtype).view_as(stats.log_prob)
    ((stats.log_prob * weights).sum() + (stats.entropy * weights.flip(0)).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return stats, grads


def assert_equal_stats_and_gradients(model, chunked, reference, mask, *, atol: float, grad_rtol: float) -> None:
    """Equal values at the trained tokens, within ``atol``; equal gradients, within ``grad_rtol`` of
    the largest entry of any."""
    got, got_grads = gradients(model, chunked)
    want, want_grads = gradients(model, reference)
    torch.testing.assert_close(got.log_prob[mask], want.log_prob[mask], rtol=0, atol=atol)
    torch.testing.assert_close(got.entropy[mask], want.entropy[mask], rtol=0, atol=atol)
    assert got_grads.keys() == want_grads.keys() and got_grads
    scale = max(float(grad.abs().max()) for grad in want_grads.values())
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=grad_rtol * scale, msg=name)


MODELS = {
    "untied": lambda: tiny_llama(tied=False),
    "tied": lambda: tiny_llama(tied=True),
    "lora-head": lambda: with_lora_head(tiny_llama(tied=False)),
}


@pytest.mark.parametrize("kind", MODELS)
def test_padded_rows_equal_the_full_log_softmax(kind):
    model, tensors = MODELS[kind](), batch()
    mask = tensors["response_mask"].bool()
    assert_equal_stats_and_gradients(
        model, lambda: ppo.response_stats(model, tensors), lambda: reference_padded(model, tensors), mask, **FLOAT64
    )


def over_passes(tensors, passes, compute) -> ppo.ResponseStats:
    """``compute(micro)``'s stats of each prefix-shared pass, placed at its rows of the batch."""
    shape = tensors["responses"].shape
    log_prob, entropy = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    for micro in passes:
        stats = compute(micro)
        log_prob[micro.rows, : micro.response_length] = stats.log_prob
        entropy[micro.rows, : micro.response_length] = stats.entropy
    return ppo.ResponseStats(log_prob=log_prob, entropy=entropy)


@pytest.mark.parametrize("kind", MODELS)
def test_prefix_shared_packs_equal_the_full_log_softmax(kind):
    model, tensors = MODELS[kind](), batch()
    passes = split_shared(tensors, None, "budget", PackCost(per_token=1.0, per_pair=0.0))
    assert any(micro.packed.attention_mask is not None for micro in passes)  # a tree: the group's prompt once
    assert_equal_stats_and_gradients(
        model,
        lambda: over_passes(tensors, passes, lambda m: ppo.response_stats(model, m.cut(tensors), m.packed)),
        lambda: over_passes(tensors, passes, lambda m: reference_packed(model, m.packed, m.cut(tensors)["responses"])),
        tensors["response_mask"].bool(),
        **FLOAT64,
    )


@pytest.mark.parametrize("where", ["around the pass", "inside the forward"])
def test_bfloat16_autocast_computes_float32_softmaxes_of_the_same_logits(where):
    """Autocast around the whole pass (the torch backend's) or inside the model's forward only
    (accelerate's, which TRL uses): the head runs under it either way, as in the model's forward."""
    model, tensors = tiny_llama(tied=False, dtype=torch.float32), batch()
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    if where == "inside the forward":
        model.forward = bf16(model.forward)
        bf16 = torch.autocast("cpu", enabled=False)

    def under_autocast(compute):
        def run():
            with bf16:
                return compute()

        return run

    chunked = under_autocast(lambda: ppo.response_stats(model, tensors))
    reference = under_autocast(lambda: reference_padded(model, tensors))
    assert chunked().log_prob.dtype == torch.float32
    mask = tensors["response_mask"].bool()
    assert_equal_stats_and_gradients(model, chunked, reference, mask, **AUTOCAST)


@pytest.mark.parametrize(
    ("family", "attribute", "value"),
    [
        ("gemma2", "final_logit_softcapping", 30.0),
        ("cohere", "logit_scale", 0.0625),
        ("granite", "logits_scaling", 8.0),
    ],
)
def test_a_model_whose_logits_are_not_its_heads_output_is_refused_by_name(family, attribute, value):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family,
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        **{attribute: value},
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=rf"'{family}' model with {attribute}={value}"):
        ppo.response_stats(model, batch())
