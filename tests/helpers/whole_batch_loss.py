"""A plugin whose policy loss ``whole_batch`` (``token_mean``'s numbers) declares that its parts do not
add up over a split mini-batch: what every backend that splits one must refuse by the key that splits."""

from __future__ import annotations

from agl_core import PolicyLossSpec, hookimpl
from agl_core.plugins import PluginManager

WHOLE_BATCH_LOSS = "actor_rollout_ref.actor.policy_loss.loss_mode=whole_batch"


class WholeBatchLoss:
    @hookimpl
    def agl_register_policy_losses(self, register):
        token_mean = PluginManager(load_entrypoints=False).policy_losses.get("token_mean")
        register("whole_batch", PolicyLossSpec(token_mean, additive_over_micro_batches=False))
