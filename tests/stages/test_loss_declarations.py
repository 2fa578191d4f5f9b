"""Losses declare what they need of the step pipeline when they register; nothing is keyed on a name."""

from __future__ import annotations

import pytest
import torch

from agl_backend_verl.policy_loss import as_verl_policy_loss
from agl_core import hookimpl
from agl_core.builtins.losses import per_rollout_mean, token_mean
from agl_core.config import load_config
from agl_core.plugins import PluginManager, RegistryError
from agl_core.stages.pipeline import StepPipeline
from agl_core.stages.policy_loss import LossSettings, PolicyLossSpec, policy_loss_spec
from agl_core.stages.tensorize import pad_responses
from tests.helpers.rollouts import two_group_batch


def clipped_twice(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    """A wrapper a plugin author might write: the built-in per-rollout loss with a tighter clip."""
    tighter = LossSettings(
        clip_ratio=settings.clip_ratio / 2, clip_ratio_c=settings.clip_ratio_c, dp_size=settings.dp_size
    )
    return per_rollout_mean(old_log_prob, log_prob, advantages, response_mask, tighter, rollout_is_weights)


class Wrappers:
    @hookimpl
    def agl_register_policy_losses(self, register):
        register("tight_declared", PolicyLossSpec(clipped_twice, scale_advantages_per_rollout=True))
        register("tight_plain", clipped_twice)


def prepared(loss_mode):
    config = load_config(
        overrides=[
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        ]
    )
    manager = PluginManager(load_entrypoints=False)
    manager.register(Wrappers())
    return StepPipeline(config, manager).prepare(two_group_batch(), step=1)


def raw(prepared_batch, width):
    """The kept rows' advantages as the estimator gave them, before any per-rollout scaling."""
    return pad_responses(prepared_batch.shaped.advantages, width, torch.float32)


def test_a_wrapper_under_a_new_name_gets_scaled_advantages_exactly_when_it_declares_them():
    builtin, declared, plain = prepared("per_rollout_mean"), prepared("tight_declared"), prepared("tight_plain")
    width = max(len(row.response_ids) for row in builtin.shaped.rows)
    assert declared.row_scales is not None
    torch.testing.assert_close(declared.advantages(width), builtin.advantages(width))
    assert not torch.equal(declared.advantages(width), raw(declared, width))
    assert plain.row_scales is None
    torch.testing.assert_close(plain.advantages(width), raw(plain, width))


def test_a_plain_function_is_a_spec_with_the_documented_defaults():
    spec = policy_loss_spec(token_mean)
    assert spec == PolicyLossSpec(token_mean, scale_advantages_per_rollout=False, additive_over_micro_batches=True)
    registered = PluginManager(load_entrypoints=False).policy_losses
    assert policy_loss_spec(registered.get("per_rollout_mean")).scale_advantages_per_rollout
    assert not policy_loss_spec(registered.get("token_mean")).scale_advantages_per_rollout


def test_a_spec_is_called_like_its_function_by_either_backend():
    spec = PolicyLossSpec(per_rollout_mean, scale_advantages_per_rollout=True)
    old = torch.zeros(2, 3)
    new = torch.full((2, 3), -0.1)
    adv = torch.tensor([[1.0, -1.0, 0.5], [0.2, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    direct = per_rollout_mean(old, new, adv, mask, LossSettings())
    torch.testing.assert_close(spec(old, new, adv, mask, LossSettings())[0], direct[0])
    verl = as_verl_policy_loss(spec)
    assert verl.__name__ == "per_rollout_mean"
    torch.testing.assert_close(verl(old, new, adv, mask, config={"clip_ratio": 0.2})[0], direct[0])


def test_a_loss_that_cannot_be_called_is_refused_naming_its_plugin():
    with pytest.raises(TypeError, match="PolicyLossSpec.fn"):
        PolicyLossSpec("per_rollout_mean")

    class Broken:
        @hookimpl
        def agl_register_policy_losses(self, register):
            register("nothing", 42)

    manager = PluginManager(load_entrypoints=False)
    name = manager.register(Broken())
    with pytest.raises(
        RegistryError, match=f"plugin '{name}' registered policy loss 'nothing' as 42, which cannot be called"
    ):
        manager.policy_losses.get("token_mean")
