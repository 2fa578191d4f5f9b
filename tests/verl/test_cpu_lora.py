"""The CPU replica's LoRA merge (:mod:`agl_backend_verl.cpu.lora`) gives the weights PEFT's own
``merge_and_unload`` gives, from the names verl's weight sync sends (PEFT's adapter state dict)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.verl

pytest.importorskip("verl")
peft = pytest.importorskip("peft")

from agl_backend_verl.cpu.lora import hf_name, lora_scale, merge_adapters  # noqa: E402
from tests.helpers.corridor_policy import build_corridor_policy  # noqa: E402


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_adapters_equal_peft_merge_and_unload(tmp_path, rslora):
    from transformers import AutoModelForCausalLM

    folder = build_corridor_policy(tmp_path / "policy")
    base_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    base = {k: v.clone() for k, v in base_model.state_dict().items()}
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=rslora)
    adapted = peft.get_peft_model(base_model, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # PEFT starts B at zero: a merge would change nothing
    adapters = peft.utils.get_peft_model_state_dict(adapted)
    assert any(".lora_A." in n for n in adapters) and all(n.startswith("base_model.model.") for n in adapters)

    merged = merge_adapters(base, adapters, lora_scale(config.to_dict()))
    expected = adapted.merge_and_unload().state_dict()

    assert merged, "no layer merged"
    for name, weight in merged.items():
        assert not torch.equal(weight, base[name]), name
        torch.testing.assert_close(weight, expected[name], rtol=1e-6, atol=1e-6)


def test_base_sync_names_and_errors():
    assert hf_name("base_model.model.model.layers.0.mlp.down_proj.base_layer.weight") == (
        "model.layers.0.mlp.down_proj.weight"
    )
    assert hf_name("model.embed_tokens.weight") == "model.embed_tokens.weight"
    base = {"m.weight": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match="'m' came with \\['lora_A'\\] only"):
        merge_adapters(base, {"base_model.model.m.lora_A.weight": torch.zeros(1, 2)}, 1.0)
    pair = {
        "base_model.model.x.lora_A.weight": torch.zeros(1, 2),
        "base_model.model.x.lora_B.weight": torch.zeros(2, 1),
    }
    with pytest.raises(ValueError, match="no base weight 'x.weight'"):
        merge_adapters(base, pair, 1.0)
