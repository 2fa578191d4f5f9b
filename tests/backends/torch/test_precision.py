"""bf16 and gradient checkpointing in the reference backend under verl's keys, checked against the
float32, non-checkpointed step; and verl itself accepting the same keys."""

from __future__ import annotations

import pytest
import torch

from agl_core.backends.micro_batching import UpdateBatch
from agl_core.backends.torch.backend import TorchBackend
from agl_core.config import ConfigError
from agl_core.data import TrainingRow
from agl_core.plugins import PluginManager
from agl_core.stages.tensorize import tensorize
from tests.helpers.torch_runs import torch_config

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
CHECKPOINTING = ["actor_rollout_ref.model.enable_gradient_checkpointing=true"]
BF16_WEIGHTS = ["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"]
BF16_AUTOCAST = ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"]


def _backend(policy, tmp_path, *extra):
    config = torch_config(policy, tmp_path, "actor_rollout_ref.actor.entropy_coeff=0.01", *extra)
    return TorchBackend(config, PluginManager.from_config(config, (), load_entrypoints=False))


def _batch(pad):
    """Four rows of random token ids with random advantages (old log-probs filled in by :func:`_step`)."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for k in range(4):
        prompt = torch.randint(
            3, 34, (int(torch.randint(4, 12, (1,), generator=generator)),), generator=generator
        ).tolist()
        response = torch.randint(
            3, 34, (int(torch.randint(3, 9, (1,), generator=generator)),), generator=generator
        ).tolist()
        rows.append(
            TrainingRow(
                prompt_ids=prompt,
                response_ids=response,
                response_mask=[1] * len(response),
                reward=0.0,
                rollout_id=f"r{k}",
                group_id="g",
            )
        )
    tensors = tensorize(rows, pad_token_id=pad).tensors
    advantages = torch.randn(tensors["responses"].shape, generator=generator) * tensors["response_mask"]
    return tensors, advantages


def _step(backend, old_log_prob=None, lora_seed=None):
    """The loss and the float32 gradients of one update's loss on :func:`_batch` (adapter B randomised
    with ``lora_seed``, so the adapter's A gets a gradient too)."""
    model, update = backend.model, backend.actor_update
    if lora_seed is not None:
        generator = torch.Generator().manual_seed(lora_seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    tensors, advantages = _batch(backend.pad_token_id)
    if old_log_prob is None:
        with torch.no_grad():
            model.eval()
            old_log_prob = update.log_probs(model, tensors, None, "unused").float() + 0.01
    model.train()
    model.zero_grad(set_to_none=True)
    rows = UpdateBatch(tensors, advantages, old_log_prob, None)
    loss, _ = update.step.loss(update.stats(rows), rows, update.settings.loss)
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.requires_grad])
    return loss.detach(), grads, old_log_prob


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("extra", [[], LORA], ids=["full", "lora"])
def test_checkpointed_gradients_equal_the_plain_ones(policy, tmp_path, extra):
    seed = 0 if extra else None
    loss, grads, old = _step(_backend(policy, tmp_path, *extra), lora_seed=seed)
    checkpointed = _backend(policy, tmp_path, *extra, *CHECKPOINTING)
    assert checkpointed.model.is_gradient_checkpointing
    loss_gc, grads_gc, _ = _step(checkpointed, old, lora_seed=seed)
    assert torch.equal(loss, loss_gc)
    assert (grads - grads_gc).abs().max().item() <= 1e-6  # measured: 0.0 for both (the recomputed forward is the same)


# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2 %) through two layers and the head.
# Measured (full / LoRA): loss relative difference 0.5 % / 1.1 % with autocast, 0.6 % / 3.0 % with bf16
# weights; gradient relative L2 difference 1.2-1.5 % (cosine 0.9999) in all four.
@pytest.mark.parametrize(
    "dtype_keys, loss_tol, grad_tol",
    [(BF16_AUTOCAST, 5e-2, 3e-2), (BF16_WEIGHTS, 5e-2, 3e-2)],
    ids=["autocast", "weights"],
)
@pytest.mark.parametrize("extra", [[], LORA], ids=["full", "lora"])
def test_a_bf16_step_matches_the_fp32_step_with_fp32_loss_and_log_probs(
    policy, tmp_path, dtype_keys, loss_tol, grad_tol, extra
):
    seed = 0 if extra else None
    loss, grads, old = _step(_backend(policy, tmp_path, *extra), lora_seed=seed)
    bf16 = _backend(policy, tmp_path, *extra, *dtype_keys)
    if dtype_keys is BF16_WEIGHTS:
        base = [p for n, p in bf16.model.named_parameters() if "lora_" not in n]
        assert all(p.dtype == torch.bfloat16 for p in base)
    loss_bf16, grads_bf16, _ = _step(bf16, old, lora_seed=seed)
    assert loss_bf16.dtype == torch.float32, "the loss is computed in float32"
    with torch.no_grad():
        tensors, _ = _batch(bf16.pad_token_id)
        assert bf16.actor_update.log_probs(bf16.model, tensors, None, "unused").dtype == torch.float32
    assert abs(loss_bf16 - loss).item() <= loss_tol * abs(loss).item()
    assert _relative(grads_bf16, grads) <= grad_tol


@pytest.mark.parametrize(
    "override, key",
    [
        ("actor_rollout_ref.actor.fsdp_config.model_dtype=fp16", "actor_rollout_ref.actor.fsdp_config.model_dtype"),
        ("actor_rollout_ref.actor.fsdp_config.model_dtype=int8", "actor_rollout_ref.actor.fsdp_config.model_dtype"),
        (
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp16",
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
        ),
        (
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=bf16",
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype",
        ),
        (
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.cast_forward_inputs=true",
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.cast_forward_inputs",
        ),
    ],
)
def test_a_dtype_the_backend_cannot_honour_is_an_error_naming_its_key(policy, tmp_path, override, key):
    with pytest.raises(ConfigError) as error:
        _backend(policy, tmp_path, override)
    assert error.value.key == key


def _verl_dataclasses():
    pytest.importorskip("verl")
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import FSDPActorConfig, HFModelConfig

    return omega_conf_to_dataclass, HFModelConfig, FSDPActorConfig


# verl's actor dataclass (holding the FSDP engine's) needs a micro-batch size, which verl's defaults leave unset.
MICRO_BATCH = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"


def test_the_verl_backend_hands_the_same_keys_to_verl_and_its_dataclasses_accept_them(policy, tmp_path):
    to_dataclass, HFModelConfig, FSDPActorConfig = _verl_dataclasses()
    from agl_backend_verl.config import load_verl_config

    overrides = [
        MICRO_BATCH,
        f"actor_rollout_ref.model.path={policy}",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=all-linear",
        "actor_rollout_ref.model.exclude_modules=down_proj",
        f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
    ]
    cfg = load_verl_config(overrides=overrides)
    model = to_dataclass(cfg.actor_rollout_ref.model, HFModelConfig)
    assert (model.lora_rank, model.lora_alpha, model.target_modules, model.exclude_modules) == (
        8,
        32,
        "all-linear",
        "down_proj",
    )
    assert model.lora_adapter_path == str(tmp_path / "adapter") and model.enable_gradient_checkpointing is False
    actor = to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, FSDPActorConfig) and actor.fsdp_config.model_dtype == "bf16"


# Forms verl's dataclasses take that its flattened defaults do not show: a key they omit, and a list
# where the default is a string.
VERL_ONLY_IN_DATACLASSES = [
    "actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: bf16, reduce_dtype: fp32}",
    "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
]


@pytest.mark.parametrize("override", VERL_ONLY_IN_DATACLASSES)
def test_the_verl_backend_hands_every_form_verl_takes_to_verl(policy, override):
    to_dataclass, HFModelConfig, FSDPActorConfig = _verl_dataclasses()
    from agl_backend_verl.config import load_verl_config

    cfg = load_verl_config(overrides=[f"actor_rollout_ref.model.path={policy}", MICRO_BATCH, override])
    to_dataclass(cfg.actor_rollout_ref.model, HFModelConfig)
    assert isinstance(to_dataclass(cfg.actor_rollout_ref.actor), FSDPActorConfig)
