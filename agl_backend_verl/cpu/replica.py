"""A CPU rollout replica for verl: agl's policy server, launched and fed weights by verl's trainer.

Registered as ``agl_cpu`` in verl's ``RolloutReplicaRegistry`` (the replica verl's
``LLMServerManager`` builds, picked by ``actor_rollout_ref.rollout.name``) and in verl's rollout
table ``verl.workers.rollout.base._ROLLOUT_REGISTRY`` (the in-process adapter each training rank
builds, through which verl's hybrid ``update_weights`` hands it the actor's weights).

- :class:`CpuReplica` runs one :class:`CpuPolicyServer` Ray actor per replica: an OpenAI-compatible
  server (on the interface and under the address :mod:`agl_backend_verl.replica_address` configures)
  answering as vLLM does (prompt and response token ids, per-token log-probs),
  :class:`agl_core.serving.policy_server.PolicyServer` serving the policy from the model path.
- :class:`CpuServerAdapter` lives in every training rank; verl's ``update_weights`` (checkpoint
  engine backend ``naive``) streams it the actor's full weights, which the replica's first rank sends
  to the server with the training step as its version. Every rank drains the stream (FSDP gathers
  each tensor collectively).

Sleep and wake free nothing on CPU (the server keeps its copy of the weights); abort refuses the
requests queued or arriving until the next resume (a batch already decoding finishes). Only verl's
hybrid mode (rollout sharing the trainer's ranks) is supported.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica

from agl_backend_verl.cpu.mode import REPLICA as NAME
from agl_backend_verl.replica_address import advertised_address, bind_host
from agl_core import Generation, PolicyServer, RequestError, SamplingParams


def server_name(replica_rank: int) -> str:
    """The Ray actor name of replica ``replica_rank``'s server (how the training ranks find it)."""
    return f"agl_cpu_rollout_server_{replica_rank}"


class AbortablePolicyServer(PolicyServer):
    """agl's policy server with vLLM's abort/resume: while aborted, requests get HTTP 503."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._accepting = threading.Event()
        self._accepting.set()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not self._accepting.is_set():
            raise RequestError("generation is paused: the replica's requests were aborted", status=503)
        result = super().generate(prompt_ids, params)
        if not self._accepting.is_set():
            raise RequestError("the request was aborted", status=503)
        return result

    def abort(self) -> None:
        self._accepting.clear()

    def resume(self) -> None:
        self._accepting.set()

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy the actor's full weights (Hugging Face names) into the served model, between batches."""
        with self._weights_lock, torch.no_grad():
            missing, unexpected = self._model.load_state_dict(dict(weights), strict=False)
            tied = {"lm_head.weight"} if getattr(self._model.config, "tie_word_embeddings", False) else set()
            if unexpected or set(missing) - tied:
                raise ValueError(
                    f"weights do not fit the served model: missing {sorted(set(missing) - tied)}, "
                    f"unexpected {sorted(unexpected)}"
                )
            self.version = version


class CpuPolicyServer:
    """A Ray actor hosting one :class:`AbortablePolicyServer` for the policy at ``model_path``."""

    def __init__(self, model_path: str, model_name: str, seed: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.server = AbortablePolicyServer(model, tokenizer, model_name, seed=seed, host=bind_host())
        self.server.start()
        self.weight_pushes = 0

    def address(self) -> str:
        return advertised_address(self.server.port)

    def version(self) -> int:
        return self.server.version

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.server.load_weights(weights, version)
        self.weight_pushes += 1

    def stats(self) -> dict[str, int]:
        return {"version": self.server.version, "weight_pushes": self.weight_pushes}

    # verl's replica server interface
    def wake_up(self) -> None:
        pass

    def sleep(self) -> None:
        pass

    def abort_all_requests(self, reject_request: bool = False) -> None:
        self.server.abort()

    def resume_generation(self) -> None:
        self.server.resume()

    def clear_kv_cache(self) -> None:
        pass  # the policy server keeps no cache between requests

    release_kv_cache = resume_kv_cache = clear_kv_cache

    def close(self) -> None:
        self.server.close()


class CpuReplica(RolloutReplica):
    """verl's rollout replica on CPU: one :class:`CpuPolicyServer` per replica (hybrid mode only)."""

    async def launch_servers(self) -> None:
        model_path = self.model_config.get("local_path") or self.model_config.path
        server = (
            ray.remote(CpuPolicyServer)
            .options(name=server_name(self.replica_rank), num_cpus=0, max_concurrency=self.max_concurrency)
            .remote(str(model_path), str(self.model_config.path), self.replica_rank)
        )
        self.servers = [server]
        self._server_handle = server
        self._server_address = await server.address.remote()

    async def init_standalone(self) -> None:
        raise NotImplementedError(
            f"rollout {NAME!r} runs in verl's hybrid mode only (actor_rollout_ref.hybrid_engine=true)"
        )

    init_colocated = init_hybrid_colocated = init_standalone


class CpuServerAdapter(BaseRollout):
    """The rollout inside each training rank: receives verl's weight updates for its replica's server."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any):
        super().__init__(config, model_config, device_mesh)
        replica_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.replica_rank, self.is_leader = divmod(rank, replica_size)[0], rank % replica_size == 0

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass

    async def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        if wire_format != "named_tensors":
            raise ValueError(f"rollout {NAME!r} takes full weights (wire format 'named_tensors'), got {wire_format!r}")
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}  # every rank drains the gather
        if self.is_leader:
            version = int(kwargs.get("global_steps") or 0)
            server = ray.get_actor(server_name(self.replica_rank))
            await server.load_weights.remote(state, version)
