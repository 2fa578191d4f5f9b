"""The narrow interface between the training step and verl's GPU-only workers.

Everything a step does between "rollouts" and "update" runs in the driver on CPU; only the calls
below need verl's FSDP workers or its vLLM replicas. :class:`VerlWorkerCalls` makes them on a
``RayPPOTrainer`` whose workers are initialised; the CPU tests replace it with a fake, so the rest
of the step runs for real.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from verl import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer


class WorkerCalls(Protocol):
    def rollout_endpoints(self) -> list[str]:
        """OpenAI base URLs (``http://host:port/v1``) of the vLLM replicas, for the gateway."""

    def resume_replicas(self) -> None:
        """Let the replicas generate (before rollouts)."""

    def abort_replicas(self) -> None:
        """Abort requests still running on the replicas (after sync rollouts: stragglers of failed agents)."""

    def sleep_replicas(self) -> None:
        """Free the replicas' GPU memory for the update (after rollouts)."""

    def old_log_probs(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        """``old_log_probs`` of the batch's responses under the current actor, and metrics."""

    def ref_log_probs(self, batch: DataProto) -> DataProto:
        """``ref_log_prob`` under the reference policy."""

    def values(self, batch: DataProto) -> DataProto:
        """``values`` from the critic."""

    def actor_dp_size(self) -> int:
        """The actor's data-parallel size: how many contiguous shares verl's dispatch cuts a batch into."""

    def update_critic(self, batch: DataProto) -> dict[str, Any]:
        """One critic update; its metrics."""

    def update_actor(self, batch: DataProto) -> dict[str, Any]:
        """One actor update (the policy loss runs in the workers); its metrics."""

    def push_weights(self, version: int) -> None:
        """Send the actor's weights to the replicas, tagged with the training step."""

    def save_checkpoint(self) -> None:
        """Save actor, critic and data-loader state for the current step."""

    def load_checkpoint(self) -> None:
        """Resume from the latest checkpoint, if ``trainer.resume_mode`` says so."""


def endpoint(address: str) -> str:
    """A replica address (``host:port``) as the OpenAI base URL the gateway registers."""
    return address if address.startswith(("http://", "https://")) else f"http://{address}/v1"


def _run(coroutine: Any) -> Any:
    return asyncio.run(coroutine) if asyncio.iscoroutine(coroutine) else coroutine


class VerlWorkerCalls:
    """:class:`WorkerCalls` on a ``RayPPOTrainer`` after ``init_workers()`` (verl 0.9.1)."""

    def __init__(self, trainer: RayPPOTrainer):
        self.trainer = trainer

    def _replicas(self) -> list[Any]:
        return list(self.trainer.llm_server_manager.get_replicas())

    def rollout_endpoints(self) -> list[str]:
        return [endpoint(a) for a in self.trainer.llm_server_manager.get_addresses()]

    def resume_replicas(self) -> None:
        async def resume() -> None:
            await asyncio.gather(*[replica.resume_generation() for replica in self._replicas()])

        _run(resume())

    def abort_replicas(self) -> None:
        async def abort() -> None:
            await asyncio.gather(*[replica.abort_all_requests() for replica in self._replicas()])

        _run(abort())

    def sleep_replicas(self) -> None:
        _run(self.trainer.checkpoint_manager.sleep_replicas())

    def old_log_probs(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        output, mfu = self.trainer._compute_old_log_prob(batch)
        output.batch.pop("entropys", None)
        return output, {"perf/mfu/actor_infer": float(mfu)}

    def ref_log_probs(self, batch: DataProto) -> DataProto:
        return self.trainer._compute_ref_log_prob(batch)

    def values(self, batch: DataProto) -> DataProto:
        return self.trainer._compute_values(batch)

    def actor_dp_size(self) -> int:
        return self.trainer._get_dp_size(self.trainer.actor_rollout_wg, "actor")

    def update_critic(self, batch: DataProto) -> dict[str, Any]:
        return self.trainer._update_critic(batch).meta_info["metrics"]

    def update_actor(self, batch: DataProto) -> dict[str, Any]:
        return self.trainer._update_actor(batch).meta_info["metrics"]

    def push_weights(self, version: int) -> None:
        _run(self.trainer.checkpoint_manager.update_weights(version))

    def save_checkpoint(self) -> None:
        self.trainer._save_checkpoint()

    def load_checkpoint(self) -> None:
        self.trainer._load_checkpoint()
