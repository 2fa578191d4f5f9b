"""The update matrix: every combination the torch backend accepts computes what a plain forward of
each row alone computes, its response log-probs and the gradients of its policy loss.

The cells are enumerated, not drawn: every model family (llama, qwen2, gpt2, and qwen2-vl on text
rows) × attention implementation (sdpa, eager) × compute dtype (float32, bf16 autocast) has a *tree*
cell, prefix sharing on with two rows that branch from a shared prefix in the same micro-batch (so at
least one pass is a real tree pass, counted and asserted), and a *padded* cell, sharing off. Inside
each cell hypothesis draws the rows (chains, branches, repeats, truncations:
:mod:`tests.helpers.training_rows`), LoRA, gradient checkpointing, the tree bound (the default, and
one that splits the drawn trees) and micro-batches of rows (``actor.ppo_micro_batch_size_per_gpu``).
The policy is built as the backend builds it (:func:`~agl_core.backends.torch.backend.build_policy`
from the config keys), its attention set, and :class:`~agl_core.backends.torch.update.ActorUpdate`
computes the old log-probs and one SGD step; the reference runs each row alone, unpadded, with no mask
and no position ids. Each cell equals it within its dtype's tolerance (below). The weights are drawn
with a standard deviation of 0.2 rather than the usual 0.02, so that a token's log-prob depends on the
tokens it attends to: a wrong mask then moves log-probs by whole units (a boolean mask added to eager
attention's scores: 2.6 to 4.9), not by the hundredths that bf16 rounds by.

What the backend cannot compute exactly is refused by name before a step runs:
``test_prefix_sharing.py::test_a_model_the_mask_does_not_describe_is_refused_naming_the_key``.
"""

from __future__ import annotations

import os

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from agl_core.backends.micro_batching import UpdateBatch
from agl_core.backends.torch.backend import build_policy
from agl_core.backends.torch.update import OLD_LOG_PROB_BUDGET_KEY, ActorSettings, ActorUpdate
from agl_core.config import load_config
from agl_core.data import TrainingRow
from agl_core.plugins import PluginManager
from agl_core.stages.tensorize import tensorize
from tests.helpers.actor_updates import applied_gradients
from tests.helpers.training_rows import training_rows

# The largest difference from the reference (for gradients, as a share of the reference's largest entry)
# each compute dtype is allowed: (log-probs, gradients). Measured with AGL_MATRIX_EXAMPLES=10 (320
# examples, 160 per dtype, half of them tree cells): float32 log-probs within 2.9e-6 and gradients within
# 4.2e-6; bf16 autocast log-probs within 0.047 and gradients within 0.046. With eager attention given
# the boolean tree mask, log-probs are off by 2.6 or more.
TOLERANCE = {"float32": (1e-4, 1e-4), "bf16": (0.1, 0.1)}
VOCAB = 256
WEIGHT_STD = 0.2


def _tiny_configs():
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    return {
        "llama": LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=512, **shape),
        "qwen2": Qwen2Config(vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=512, **shape),
        "gpt2": GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        ),
    }


def _redraw(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every matrix and embedding of ``model`` drawn again from N(0, WEIGHT_STD²)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.ndim >= 2:
                weight.copy_(torch.randn(weight.shape, generator=generator) * WEIGHT_STD)
    return model


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory, vision_policy_dir) -> dict[str, tuple[str, int]]:
    """Family -> (its tiny model's folder, the largest token id its rows may use)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    folders = {}
    for seed, (family, config) in enumerate(_tiny_configs().items()):
        folder = tmp_path_factory.mktemp(family)
        _redraw(AutoModelForCausalLM.from_config(config), seed).save_pretrained(folder)
        folders[family] = (str(folder), VOCAB - 1)
    vision = AutoModelForImageTextToText.from_pretrained(vision_policy_dir)
    vision_folder = tmp_path_factory.mktemp("qwen2_vl")
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        source = vision_policy_dir / name
        if source.is_file():
            (vision_folder / name).write_bytes(source.read_bytes())
    _redraw(vision, len(folders)).save_pretrained(vision_folder)
    folders["qwen2_vl"] = (str(vision_folder), int(vision.config.get_text_config().vocab_size) - 1)
    return folders


FAMILIES = ("llama", "qwen2", "gpt2", "qwen2_vl")
COMBINATIONS = [(f, a, d) for f in FAMILIES for a in ("sdpa", "eager") for d in ("float32", "bf16")]


@attrs.frozen
class Cell:
    family: str
    attention: str
    dtype: str
    lora: bool
    checkpointing: bool
    share: bool
    max_tree_tokens: int
    micro_rows: int | None

    def overrides(self) -> list[str]:
        out = [
            "actor_rollout_ref.actor.policy_loss.loss_mode=token_mean",
            "actor_rollout_ref.actor.grad_clip=1e9",
            f"actor_rollout_ref.model.enable_gradient_checkpointing={self.checkpointing}",
            f"agentlightning.torch.share_prefixes={self.share}",
            f"agentlightning.torch.max_tree_tokens={self.max_tree_tokens}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={self.micro_rows or 'null'}",
        ]
        if self.lora:
            out += ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]
        if self.dtype == "bf16":
            out.append(
                "actor_rollout_ref.actor.fsdp_config.mixed_precision="
                "{param_dtype: bf16, reduce_dtype: fp32, buffer_dtype: fp32}"
            )
        return out


def cells(family: str, attention: str, dtype: str, layout: str) -> st.SearchStrategy[Cell]:
    """The cells of one family × attention × dtype: ``tree`` shares prefixes, its micro-batches of rows
    keeping the branching pair together (one pass, or two rows); ``padded`` does not share."""
    tree = layout == "tree"
    return st.builds(
        Cell,
        family=st.just(family),
        attention=st.just(attention),
        dtype=st.just(dtype),
        lora=st.booleans(),
        checkpointing=st.booleans(),
        share=st.just(tree),
        max_tree_tokens=st.sampled_from([8192, 40]),  # the default, and a bound that splits drawn trees
        micro_rows=st.sampled_from([None, 2] if tree else [None, 1, 2]),
    )


def cell_update(cell: Cell, folder: str) -> ActorUpdate:
    """The actor update the torch backend builds for ``cell``'s keys, on the policy in ``folder``."""
    from pathlib import Path

    config = load_config(overrides=cell.overrides())
    torch_config = config.agentlightning.torch
    settings = ActorSettings.from_config(
        config.actor_rollout_ref, torch_config.share_prefixes, torch_config.max_tree_tokens
    )
    model, _ = build_policy(config, Path(folder), torch.device("cpu"), settings.precision.param_dtype)
    model.set_attn_implementation(cell.attention)
    trained = [p for p in model.parameters() if p.requires_grad]
    loss = PluginManager(load_entrypoints=False).policy_losses.get("token_mean")
    return ActorUpdate(model, None, torch.optim.SGD(trained, lr=1.0), loss, settings, torch.device("cpu"), 0)


def per_row_reference(update: ActorUpdate, rows: list[TrainingRow], advantages: torch.Tensor):
    """Each row's response log-probs from a forward of the row alone (no padding, no mask, no position
    ids), ``[rows, width of advantages]``, and the gradient of the token-mean policy loss they give (at
    ratio 1)."""
    model = update.model
    log_probs, loss = torch.zeros(advantages.shape), torch.zeros(())
    n_trained = sum(float(r.response_mask.sum()) for r in rows)
    for i, row in enumerate(rows):
        ids = torch.as_tensor(np.concatenate([row.prompt_ids, row.response_ids]))[None]
        with update.settings.precision.autocast(torch.device("cpu")):
            logits = model(input_ids=ids, use_cache=False).logits
        predicted = torch.log_softmax(logits.float()[0, len(row.prompt_ids) - 1 : -1], dim=-1)
        chosen = predicted.gather(-1, ids[0, len(row.prompt_ids) :, None])[:, 0]
        log_probs[i, : len(chosen)] = chosen.detach()
        weights = advantages[i, : len(chosen)] * torch.tensor(row.response_mask, dtype=torch.float32)
        loss = loss - (weights * chosen).sum() / n_trained
    parameters = [p for p in model.parameters() if p.requires_grad]
    gradients = torch.autograd.grad(loss, parameters, allow_unused=True)  # a vision tower has none
    return log_probs, {
        name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(_trained(model), gradients)
    }


def _trained(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def tree_passes(update: ActorUpdate, tensors: dict, batch: UpdateBatch) -> tuple[int, int]:
    """How many passes of the old log-probs and of the update step compute a tree (a pack whose rows
    branch, under a tree mask)."""
    old = update.split(tensors, None, OLD_LOG_PROB_BUDGET_KEY) if update.shares(tensors) else []
    parts = update.mini_batch(batch).parts
    return tuple(sum(p.packed is not None and p.packed.attention_mask is not None for p in ps) for ps in (old, parts))


# Each cell draws AGL_MATRIX_EXAMPLES examples (default 1: 32 updates in CI, about 15 s on a quiet
# machine; before a release, 10: about 5 minutes on two processes). No shrinking: a failing cell is
# reported as drawn (shrinking re-runs whole updates).
EXAMPLES = settings(
    deadline=None,
    max_examples=int(os.environ.get("AGL_MATRIX_EXAMPLES", "1")),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.mark.parametrize("layout", ["tree", "padded"])
@pytest.mark.parametrize(("family", "attention", "dtype"), COMBINATIONS, ids=["-".join(c) for c in COMBINATIONS])
@given(data=st.data())
@EXAMPLES
def test_every_accepted_cell_computes_a_plain_per_row_forwards_log_probs_and_gradients(
    family_folders, family, attention, dtype, layout, data
):
    cell = data.draw(cells(family, attention, dtype, layout), label="cell")
    folder, max_token = family_folders[cell.family]
    rows = data.draw(training_rows(branching=cell.share, max_rows=5, max_length=60, max_token=max_token), label="rows")
    update = cell_update(cell, folder)
    tensors = tensorize(rows, pad_token_id=0).tensors
    trained = tensors["response_mask"].bool()
    advantages = torch.as_tensor(np.random.default_rng(len(rows)).normal(size=trained.shape), dtype=torch.float32)
    update.model.train()  # gradient checkpointing acts in training mode; every dropout is 0
    reference, reference_gradients = per_row_reference(update, rows, advantages)
    batch = UpdateBatch(tensors, advantages * tensors["response_mask"], reference, None)
    old_trees, update_trees = tree_passes(update, tensors, batch)
    if cell.share:  # the branching pair is one tree in each pass over it: coverage by construction
        assert old_trees >= 1 and update_trees >= 1, (old_trees, update_trees)
    else:
        assert old_trees == update_trees == 0
    with torch.no_grad():
        log_probs = update.log_probs(update.model, tensors, None, OLD_LOG_PROB_BUDGET_KEY)
    log_prob_tolerance, gradient_tolerance = TOLERANCE[cell.dtype]
    responses = tensors["attention_mask"][:, tensors["prompts"].shape[1] :].bool()
    torch.testing.assert_close(log_probs[responses], reference[responses], rtol=0, atol=log_prob_tolerance)

    gradients, metrics = applied_gradients(update, batch)
    if cell.micro_rows is not None:  # every micro-batch of rows is one pass at least (more when packed)
        assert metrics["actor/n_micro_batches"] >= -(-len(rows) // cell.micro_rows)
    scale = max(float(g.abs().max()) for g in reference_gradients.values())
    assert scale > 0
    for name, gradient in reference_gradients.items():
        torch.testing.assert_close(
            gradients[name], gradient, rtol=0, atol=gradient_tolerance * scale, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_eager_attention_in_float64_gives_padded_rows_their_per_row_log_probs(family_folders):
    """transformers' eager attention, given the 2-D mask, leaves a left-padding token attending to
    nothing; in float64 that is NaN, and it reached every real token of the row."""
    from agl_core.backends.ppo import response_log_probs
    from agl_core.backends.torch.backend import load_policy

    model = load_policy(family_folders["llama"][0], torch.device("cpu"), dtype=torch.float64)
    model.set_attn_implementation("eager")
    rows = [
        TrainingRow(
            prompt_ids=np.arange(3, 3 + n),
            response_ids=np.arange(40, 48),
            response_mask=np.ones(8),
            reward=0.0,
            rollout_id=f"r{n}",
            group_id="g",
        )
        for n in (2, 9)
    ]
    tensors = tensorize(rows, pad_token_id=0).tensors
    with torch.no_grad():
        padded = response_log_probs(model, tensors)
        alone = [
            torch.log_softmax(model(input_ids=torch.as_tensor([[*r.prompt_ids, *r.response_ids]])).logits[0], -1)
            for r in rows
        ]
    for i, (row, distributions) in enumerate(zip(rows, alone)):
        n = len(row.prompt_ids)
        expected = distributions[n - 1 : -1].gather(-1, torch.as_tensor(row.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(padded[i, :8].double(), expected, rtol=0, atol=1e-5)  # read out in float32
