"""Dropout off in the update (``agentlightning.disable_dropout``): the probabilities a config names are
zeroed before the model is built, and what is left is refused by name.

Which backends load their policy this way (torch, trl, the ddp example) and verl's override mapping:
tests/trl/test_dropout_off.py and tests/verl/test_verl_dropout.py.
"""

from __future__ import annotations

import pytest
import torch

from agl_core.backends.dropout import (
    DISABLE_DROPOUT,
    check_no_dropout_layers,
    check_train_mode_exact,
    dropout_overrides,
    load_update_model,
)
from agl_core.config import ConfigError

IDS = torch.arange(1, 9)[None]


def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """A tiny GPT-2, whose config has GPT-2's dropout (0.1 on embeddings, attention and residuals)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_gpt2_config()).save_pretrained(folder)
    return folder


def _train_eval_difference(model: torch.nn.Module) -> float:
    with torch.no_grad():
        train, evaluated = (model.train(mode)(input_ids=IDS).logits for mode in (True, False))
    return float((train - evaluated).abs().max())


def test_the_overrides_zero_every_probability_a_config_names_nested_configs_included():
    from transformers import LlamaConfig, Qwen2VLConfig

    assert dropout_overrides(_gpt2_config()) == {
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
    }
    assert dropout_overrides(LlamaConfig(attention_dropout=0.2)) == {"attention_dropout": 0.0}
    assert dropout_overrides(LlamaConfig()) == {}  # nothing to turn off
    vision = Qwen2VLConfig(text_config={"attention_dropout": 0.3})
    assert dropout_overrides(vision) == {"text_config": {"attention_dropout": 0.0}}


def test_the_update_model_computes_in_train_mode_what_it_computes_in_eval_mode(gpt2_folder):
    kept = load_update_model(gpt2_folder, disable_dropout=False)
    assert _train_eval_difference(kept) > 1e-3  # the model's own dropout, kept when asked
    off = load_update_model(gpt2_folder, disable_dropout=True)
    assert _train_eval_difference(off) == 0.0
    assert off.training == kept.training  # the check restores the mode it found


def test_a_dropout_layer_the_config_does_not_set_is_refused_by_name(monkeypatch):
    from transformers.models.gpt2 import modeling_gpt2

    built = modeling_gpt2.GPT2MLP.__init__

    def with_fixed_dropout(self, *args, **kwargs):
        built(self, *args, **kwargs)
        self.fixed = torch.nn.Dropout(0.5)

    monkeypatch.setattr(modeling_gpt2.GPT2MLP, "__init__", with_fixed_dropout)
    with pytest.raises(ConfigError, match=rf"{DISABLE_DROPOUT}: the model in gpt2-folder has dropout .*mlp\.fixed"):
        check_no_dropout_layers(_gpt2_config(), "gpt2-folder")


def test_randomness_left_in_train_mode_is_refused_by_name(gpt2_folder):
    model = load_update_model(gpt2_folder, disable_dropout=True)
    check_train_mode_exact(model, "gpt2-folder")
    model.transformer.ln_f.register_forward_hook(
        lambda module, args, out: out + torch.randn_like(out) if module.training else out
    )
    with pytest.raises(ConfigError, match=rf"{DISABLE_DROPOUT}: .*computes differently in train mode.*=false"):
        check_train_mode_exact(model, "gpt2-folder")
