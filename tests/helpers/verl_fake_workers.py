"""The verl trainer's GPU-only worker calls, faked: recorded, with the actor update running verl's
registered policy loss for real."""

from __future__ import annotations

from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import get_policy_loss_fn


class FakeWorkers:
    """The GPU-only calls, recorded; the actor update runs verl's registered policy loss for real."""

    def __init__(self, config, dp_size=1):
        self.config = config
        self.dp_size = dp_size
        self.calls: list[tuple] = []
        self.updated: list[DataProto] = []
        self.losses: list[float] = []

    def rollout_endpoints(self):
        return ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"]

    def resume_replicas(self):
        self.calls.append(("resume",))

    def abort_replicas(self):
        self.calls.append(("abort",))

    def sleep_replicas(self):
        self.calls.append(("sleep",))

    def old_log_probs(self, batch):
        self.calls.append(("old_log_probs", len(batch)))
        return DataProto.from_dict(tensors={"old_log_probs": batch.batch["rollout_log_probs"].clone()}), {
            "perf/mfu/actor_infer": 0.0
        }

    def ref_log_probs(self, batch):
        raise AssertionError("no reference policy is configured")

    def values(self, batch):
        raise AssertionError("no critic is configured")

    def actor_dp_size(self):
        self.calls.append(("dp_size",))
        return self.dp_size

    def update_critic(self, batch):
        raise AssertionError("no critic is configured")

    def update_actor(self, batch):
        import torch

        self.calls.append(("update_actor", len(batch)))
        self.updated.append(batch)
        actor = OmegaConf.to_container(self.config.actor_rollout_ref.actor, resolve=True)
        actor["global_batch_info"] = {"dp_size": 1}
        loss_fn = get_policy_loss_fn(self.config.actor_rollout_ref.actor.policy_loss.loss_mode)
        old = batch.batch["old_log_probs"]
        loss, metrics = loss_fn(
            old,
            old + 0.01 * torch.ones_like(old),
            batch.batch["advantages"],
            batch.batch["response_mask"],
            config=OmegaConf.create(actor),
        )
        self.losses.append(float(loss))
        return {**metrics, "actor/pg_loss": [float(loss)]}

    def push_weights(self, version):
        self.calls.append(("push", version))

    def save_checkpoint(self):
        self.calls.append(("save",))

    def load_checkpoint(self):
        self.calls.append(("load",))
