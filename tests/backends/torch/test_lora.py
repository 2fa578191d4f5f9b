"""LoRA in the reference backend, under verl's keys: what trains, what is served, what is saved."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from agl_core.backends.checkpoints import latest_checkpoint
from agl_core.backends.ppo import response_log_probs
from agl_core.backends.torch.backend import TorchBackend, load_policy
from agl_core.backends.torch.checks import check_torch_config
from agl_core.config import ConfigError
from agl_core.plugins import PluginManager
from agl_core.runs.train import run
from agl_core.serving.weights import save_served, served_state_dict
from tests.helpers.torch_runs import (
    CONFIG,
    SAMPLES,
    Running,
    corridor_run,
    randomise_adapter,
    resume_overrides,
    served_log_probs,
    tensors_of,
    torch_config,
)

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
ADAPTER_PREFIXES = ("lora_A", "lora_B")


def _backend(policy, tmp_path, *extra):
    config = torch_config(policy, tmp_path, *extra)
    return TorchBackend(config, PluginManager.from_config(config, (), load_entrypoints=False))


def _prompt(backend):
    text = backend.tokenizer.apply_chat_template(
        [{"role": "user", "content": "junction 1 : the sign points left"}], tokenize=False, add_generation_prompt=True
    )
    return backend.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_only_the_adapter_trains_and_the_engine_serves_the_merged_policy_after_every_push(policy, tmp_path):
    r = Running(
        torch_config(policy, tmp_path, *LORA, "agentlightning.local.agent_class=tests.helpers.agents:NoisyRewardAgent")
    )
    try:
        backend = r.backend
        trained = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
        names = {n for n, p in backend.model.named_parameters() if id(p) in trained}
        assert names and all(any(part in n for part in ADAPTER_PREFIXES) for n in names)
        assert all(not p.requires_grad for n, p in backend.model.named_parameters() if n not in names)
        base_before = {k: v.clone() for k, v in backend.model.get_base_model().state_dict().items() if "lora_" not in k}

        backend.train_step(SAMPLES)

        base_after = backend.model.get_base_model().state_dict()
        assert all(torch.equal(v, base_after[k]) for k, v in base_before.items()), "a base weight changed"
        assert any(p.abs().sum() > 0 for n, p in backend.model.named_parameters() if "lora_B" in n), (
            "the adapter did not train"
        )
        prompt = _prompt(backend)
        ids, served = served_log_probs(backend.engine, prompt, [0, 0])
        with torch.no_grad():
            backend.model.eval()
            expected = response_log_probs(backend.model, tensors_of(prompt, ids, backend.pad_token_id))[
                0, : len(ids)
            ].tolist()
        assert served == pytest.approx(expected, abs=1e-5)
        assert backend.engine.version == 1
    finally:
        r.close()


def test_the_reference_is_the_base_model_with_the_adapter_disabled(policy, tmp_path):
    backend = _backend(policy, tmp_path, *LORA, "actor_rollout_ref.actor.use_kl_loss=true")
    update = backend.actor_update
    assert update.ref_model is backend.model, "no second copy of the weights"
    randomise_adapter(backend.model)
    tensors = tensors_of(_prompt(backend), [5, 9, 12, 2], backend.pad_token_id)
    base = load_policy(policy, torch.device("cpu"), frozen=True)
    with torch.no_grad():
        backend.model.eval()
        with update.reference() as reference:
            ref = update.log_probs(reference, tensors, None, "unused")
        adapted = update.log_probs(backend.model, tensors, None, "unused")
        expected = update.log_probs(base, tensors, None, "unused")  # the same passes over the base model
    assert (ref - expected).abs().max().item() == 0.0  # measured: 0 (the disabled adapter is not computed)
    assert (adapted - expected).abs().max().item() > 1e-3, "the adapter should change the policy"


def test_served_and_exported_weights_are_the_merged_policy(policy, tmp_path):
    from transformers import AutoModelForCausalLM

    backend = _backend(policy, tmp_path, *LORA)
    randomise_adapter(backend.model)
    tensors = tensors_of(_prompt(backend), [5, 9, 12, 2], backend.pad_token_id)
    save_served(backend.model, tmp_path / "merged")  # what the vLLM engine loads, and merged_model_dir holds
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert set(merged.state_dict()) == set(served_state_dict(backend.model))
    with torch.no_grad():
        backend.model.eval()
        diff = (response_log_probs(merged, tensors) - response_log_probs(backend.model, tensors)).abs().max().item()
    assert diff < 1e-5  # measured: ~5e-7 (merging only reorders float sums)


def _lora_run(policy, run_dir, steps, *extra):
    overrides = [*resume_overrides(policy, run_dir, steps), "actor_rollout_ref.actor.optim.lr=1e-2", *LORA, *extra]
    run(CONFIG, overrides, show_progress=False)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_an_adapter_only_checkpoint_resumes_bit_for_bit_and_the_run_exports_the_merged_model(policy, tmp_path):
    from transformers import AutoModelForCausalLM

    straight = _lora_run(
        policy, tmp_path / "straight", 4, f"agentlightning.torch.merged_model_dir={tmp_path / 'merged'}"
    )
    _lora_run(policy, tmp_path / "resumed", 2)
    resumed = _lora_run(policy, tmp_path / "resumed", 4)

    checkpoint = latest_checkpoint(tmp_path / "resumed")
    assert sorted(p.name for p in checkpoint.iterdir()) == ["adapter", "trainer_state.pt"]
    adapter = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    assert adapter and all(any(part in k for part in ADAPTER_PREFIXES) for k in adapter), "only the adapter is saved"
    expected = load_file(tmp_path / "straight" / "global_step_4" / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == expected.keys() and all(torch.equal(adapter[k], expected[k]) for k in adapter)
    state, expected_state = (
        torch.load(p / "global_step_4" / "trainer_state.pt", weights_only=False)
        for p in (tmp_path / "resumed", tmp_path / "straight")
    )
    for a, b in zip(state["optimizer"]["state"].values(), expected_state["optimizer"]["state"].values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    losses = [(m["step"], m.get("actor/pg_loss"), m["training/reward"]) for m in resumed]
    assert losses == [(m["step"], m.get("actor/pg_loss"), m["training/reward"]) for m in straight]

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base = load_policy(policy, torch.device("cpu"))
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed), "the adapters are merged into the linear layers"
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


def test_lora_adapter_path_continues_a_saved_adapter(policy, tmp_path):
    first = _backend(policy, tmp_path / "a", *LORA)
    randomise_adapter(first.model)
    first.model.save_pretrained(tmp_path / "adapter")
    second = _backend(
        policy, tmp_path / "b", *LORA, f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}"
    )
    ours, theirs = served_state_dict(first.model), served_state_dict(second.model)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(p.requires_grad for p in second.model.parameters()), "a loaded adapter keeps training"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["actor_rollout_ref.model.target_modules=[no_such_layer]"], "actor_rollout_ref.model.target_modules"),
        (
            ["actor_rollout_ref.model.lora_rank=0", "actor_rollout_ref.model.lora_adapter_path=/nowhere"],
            "actor_rollout_ref.model.lora_adapter_path",
        ),
        (["actor_rollout_ref.model.lora_adapter_path=/nowhere"], "actor_rollout_ref.model.lora_adapter_path"),
        (["actor_rollout_ref.model.lora_rank=-1"], "actor_rollout_ref.model.lora_rank"),
        (["actor_rollout_ref.model.lora_alpha=0"], "actor_rollout_ref.model.lora_alpha"),
        (["actor_rollout_ref.model.target_modules=[]"], "actor_rollout_ref.model.target_modules"),
    ],
)
def test_a_lora_setting_the_backend_cannot_honour_is_an_error_naming_its_key(policy, tmp_path, overrides, key):
    with pytest.raises(ConfigError) as error:
        _backend(policy, tmp_path, *LORA, *overrides)
    assert error.value.key == key


def test_an_adapter_of_another_kind_or_shape_is_refused_by_agl_check(policy, tmp_path):
    first = _backend(policy, tmp_path / "a", *LORA)
    first.model.save_pretrained(tmp_path / "adapter")
    path = f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}"
    with pytest.raises(ConfigError) as error:
        check_torch_config(torch_config(policy, tmp_path, *LORA, path, "actor_rollout_ref.model.lora_rank=4"))
    assert error.value.key == "actor_rollout_ref.model.lora_rank"
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "use_dora": True}))
    with pytest.raises(ConfigError, match="DoRA") as error:
        check_torch_config(torch_config(policy, tmp_path, *LORA, path))
    assert error.value.key == "actor_rollout_ref.model.lora_adapter_path"


# The corridor with LoRA: every linear layer and the output head adapted (rank 16, alpha 32), lr 2e-3.
# The head is adapted because the example's policy draws it at std 0.02 (see build_policy.py): frozen,
# its logits stay too flat for sampled answers to be sure, so with target_modules=all-linear (head
# left out) greedy validation reached 1.0 by step 60 while the sampled reward stayed at 0.2-0.3 over
# 80 steps. With the head, seed 0 passed a sampled reward of 0.9 at step 33 (the full fine-tune of
# test_example_learns.py at step 32) and greedy validation was 1.0 from step 30.
LORA_CORRIDOR = [
    "actor_rollout_ref.model.lora_rank=16",
    "actor_rollout_ref.model.lora_alpha=32",
    "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
    "actor_rollout_ref.actor.optim.lr=2e-3",
]
CORRIDOR_STEPS = 40


@pytest.mark.slow
def test_lora_teaches_the_corridor_policy_to_follow_the_signs(tmp_path):
    lines = corridor_run(tmp_path, CORRIDOR_STEPS, *LORA_CORRIDOR)
    rewards = [line["training/reward"] for line in lines if line["step"] > 0]
    assert len(rewards) == CORRIDOR_STEPS
    assert rewards[0] < 0.2, "a random policy should start near the 0.03 baseline"
    assert max(rewards) >= 0.9, rewards
    assert lines[-1]["val/reward"] >= 0.9, "greedy answers should follow the signs (always one direction scores 0.5)"
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards
