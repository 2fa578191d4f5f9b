"""The CPU replica's LoRA merge (:mod:`agl_backend_verl.cpu.lora`) gives the weights PEFT's own
``merge_and_unload`` gives, from the names verl's weight sync sends (PEFT's adapter state dict)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.verl

pytest.importorskip("verl")
peft = pytest.importorskip("peft")

from agl_backend_verl.cpu.lora import hf_name, lora_scale, merge_adapters  # noqa: E402
from agl_core import hookimpl, rollout_level  # noqa: E402
from agl_core.plugins import DISABLE_AUTOLOAD_ENV  # noqa: E402
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


class Alternating:
    """An estimator plugin whose advantages never vanish (+1, -1 by place in the group), so every step
    moves the LoRA adapters whatever the untrained policy's rewards."""

    @hookimpl
    def agl_register_advantage_estimators(self, register):
        register(
            "alternating",
            lambda rows, settings: rollout_level(
                rows, "alternating", 2, lambda rewards: np.where(np.arange(len(rewards)) % 2 == 0, 1.0, -1.0)
            ),
        )


@pytest.mark.ray
@pytest.mark.slow
def test_a_lora_run_serves_the_adapters_it_trains(tmp_path):
    """Two sync steps of the corridor with LoRA on verl's CPU mode: step 1 moves the adapters (a
    non-zero gradient), and step 2's rollouts, served by the CPU replica after the adapters were
    merged into its weights, have the log-probs the LoRA actor computes for them."""
    import ray

    from agl_backend_verl.config import load_verl_config
    from agl_backend_verl.cpu import CPU_KEYS
    from agl_backend_verl.run import train
    from examples.corridor.build_policy import build
    from tests.helpers.paths import REPO_ROOT

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    policy = build(tmp_path / "policy", seed=0)
    corridor = REPO_ROOT / "examples" / "corridor"
    config = load_verl_config(
        str(corridor / "config.yaml"),
        [
            *CPU_KEYS,
            "agentlightning.backend=verl",
            f"actor_rollout_ref.model.path={policy}",
            f"data.train_files={corridor / 'dataset.jsonl'}",
            f"data.val_files={corridor / 'val.jsonl'}",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.lora_alpha=16",
            "actor_rollout_ref.model.target_modules=all-linear",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "algorithm.adv_estimator=alternating",
            "trainer.total_training_steps=2",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    steps = {}
    os.environ[DISABLE_AUTOLOAD_ENV] = "1"
    try:
        train(
            config,
            plugins=[Alternating()],
            on_step=lambda step, total, metrics, samples=None: steps.update({step: metrics}),
        )
    finally:
        ray.shutdown()
        os.environ.pop(DISABLE_AUTOLOAD_ENV, None)
    print({s: {k: m.get(k) for k in ("actor/grad_norm", "training/rollout_probs_diff_max")} for s, m in steps.items()})
    assert sorted(steps) == [1, 2]
    assert steps[1]["actor/grad_norm"] > 0, "step 1 did not move the adapters"
    assert steps[2]["training/rollout_probs_diff_max"] < 1e-4, "the replica does not serve the trained adapters"
