"""A CPU rollout replica for verl: agl's policy server, launched and fed weights by verl's trainer.

Registered as ``agl_cpu`` in verl's ``RolloutReplicaRegistry`` (the replica verl's
``LLMServerManager`` builds, picked by ``actor_rollout_ref.rollout.name``) and in verl's rollout
table ``verl.workers.rollout.base._ROLLOUT_REGISTRY`` (the server adapter through which verl hands
a replica its weights).

- :class:`CpuReplica` runs one :class:`CpuPolicyServer` Ray actor per replica: an OpenAI-compatible
  server (on the interface and under the address :mod:`agl_backend_verl.replica_address` configures)
  answering as vLLM does (prompt and response token ids, per-token log-probs),
  :class:`agl_core.serving.policy_server.PolicyServer` serving the policy from the model path.
- :class:`CpuServerAdapter` receives the actor's full weights and sends them to its replica's
  server with the training step as their version (from the replica's first rank; every rank drains
  the stream). In verl's hybrid mode (``sync``, ``colocate_async``, and the trainer's own replicas of
  ``separate_async``) it lives in every training rank and verl's ``update_weights`` streams it the
  weights in process (checkpoint engine ``naive``). In verl's standalone mode (the rollout pool of
  ``separate_async``) verl's ``init_standalone`` gives the replica its own resource pool of
  ``verl_cpu_rank`` bundles, with one ``CheckpointEngineWorker`` per rank holding the adapter; the
  weights reach them through the checkpoint engine of
  :mod:`agl_backend_verl.cpu.checkpoint_engine`, and the server is placed in that pool. A LoRA run's adapters
  are merged into the served base weights (:mod:`agl_backend_verl.cpu.lora`).

Sleep and wake free nothing on CPU (the server keeps its copy of the weights; its ``stats`` say how
often verl put it to sleep and whether it sleeps until the next weight push). Abort and resume are
verl's partial-rollout gate: while aborted, new requests wait for the resume (or are refused with
HTTP 503 when verl rejects them, as when it takes a replica out of generation); a batch already
decoding finishes with the weights it started with, since weights change between batches only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import AsyncIterable, Iterable, Mapping
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica
from verl.workers.rollout.utils import ensure_async_iterator

from agl_backend_verl.cpu.lora import hf_name, is_adapter, lora_scale, merge_adapters
from agl_backend_verl.cpu.mode import REPLICA as NAME
from agl_backend_verl.replica_address import advertised_address, bind_host
from agl_core import Generation, PolicyServer, RequestError, SamplingParams, UsageError, load_policy_model


def release_freed_memory() -> None:
    """Hand the memory of freed buffers back to the system (glibc's ``malloc_trim``; nothing elsewhere).

    Each weight push arrives as a copy of the whole state, unpickled into buffers glibc keeps in its
    heaps once freed (a verl CPU run serving SmolLM2-135M ran out of 24 GiB at step 6, its replica
    growing about 0.8 GiB a step). ``benchmarks/bench_replica_memory.py``: fed a 135M-parameter state
    8 times, a replica that trims stays at its first size; one that does not holds about one more
    state (516 MiB) and creeps on."""
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:
        trim(0)


def server_name(replica_rank: int) -> str:
    """The Ray actor name of replica ``replica_rank``'s server (how the training ranks find it)."""
    return f"agl_cpu_rollout_server_{replica_rank}"


class AbortablePolicyServer(PolicyServer):
    """agl's policy server with the abort/resume gate of verl's replicas (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._gate = threading.Condition()
        self._open = True
        self._rejecting = False
        self._base: dict[str, torch.Tensor] | None = None  # LoRA: the weights adapters are merged into

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        with self._gate:
            while not self._open:
                if self._rejecting:
                    raise RequestError("generation is stopped: the replica's requests were aborted", status=503)
                self._gate.wait()
        return super().generate(prompt_ids, params)

    def abort(self, reject: bool = False) -> None:
        """Hold new requests until :meth:`resume`; with ``reject``, refuse them (and those held) instead."""
        with self._gate:
            self._open, self._rejecting = False, reject
            self._gate.notify_all()

    def resume(self) -> None:
        with self._gate:
            self._open, self._rejecting = True, False
            self._gate.notify_all()

    def close(self) -> None:
        self.abort(reject=True)
        super().close()

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy the actor's full weights into the served model, between batches (PEFT's names of a
        LoRA run's base weights are taken as the plain model's: :func:`~agl_backend_verl.cpu.lora.hf_name`)."""
        state = {hf_name(name): tensor for name, tensor in weights.items()}
        with self._weights_lock, torch.no_grad():
            missing, unexpected = self._model.load_state_dict(state, strict=False)
            tied = {"lm_head.weight"} if getattr(self._model.config, "tie_word_embeddings", False) else set()
            if unexpected or set(missing) - tied:
                raise UsageError(
                    f"weights do not fit the served model: missing {sorted(set(missing) - tied)}, "
                    f"unexpected {sorted(unexpected)}"
                )
            self._base = None  # the base of later adapters: these weights
            self.version = version

    def load_adapters(self, adapters: Mapping[str, torch.Tensor], scale: float, version: int) -> None:
        """Serve the base weights with LoRA ``adapters`` merged in
        (:func:`~agl_backend_verl.cpu.lora.merge_adapters`).
        """
        with self._weights_lock, torch.no_grad():
            if self._base is None:
                self._base = {k: v.detach().clone() for k, v in self._model.state_dict().items()}
            merged = merge_adapters(self._base, adapters, scale)
            self._model.load_state_dict(merged, strict=False)
            self.version = version


class CpuPolicyServer:
    """A Ray actor hosting one :class:`AbortablePolicyServer` for the policy at ``model_path``."""

    def __init__(self, model_path: str, model_name: str, seed: int = 0):
        from transformers import AutoTokenizer

        torch.set_num_threads(1)
        model = load_policy_model(model_path, dtype=torch.float32, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.server = AbortablePolicyServer(model, tokenizer, model_name, seed=seed, host=bind_host())
        self.server.start()
        self.weight_pushes = 0
        self.sleeps = 0
        self.asleep = False

    def address(self) -> str:
        return advertised_address(self.server.port)

    def version(self) -> int:
        return self.server.version

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.server.load_weights(weights, version)
        self._loaded()

    def load_adapters(self, adapters: Mapping[str, torch.Tensor], scale: float, version: int) -> None:
        self.server.load_adapters(adapters, scale, version)
        self._loaded()

    def _loaded(self) -> None:
        self.weight_pushes += 1
        self.asleep = False  # verl's hybrid update_weights wakes a replica by loading its weights
        release_freed_memory()

    def stats(self) -> dict[str, Any]:
        """The served weights' version, how many pushes and sleeps verl made, and whether it sleeps now."""
        return {
            "version": self.server.version,
            "weight_pushes": self.weight_pushes,
            "sleeps": self.sleeps,
            "asleep": self.asleep,
        }

    # verl's replica server interface (sleeping frees nothing on CPU; it is recorded)
    def wake_up(self) -> None:
        self.asleep = False

    def sleep(self) -> None:
        self.sleeps += 1
        self.asleep = True

    def abort_all_requests(self, reject_request: bool = False) -> None:
        self.server.abort(reject=reject_request)

    def resume_generation(self) -> None:
        self.server.resume()

    def clear_kv_cache(self) -> None:
        pass  # the policy server keeps no cache between requests

    release_kv_cache = resume_kv_cache = clear_kv_cache

    def close(self) -> None:
        self.server.close()


class CpuReplica(RolloutReplica):
    """verl's rollout replica on CPU: one :class:`CpuPolicyServer` per replica, in verl's hybrid or
    standalone mode."""

    async def launch_servers(self) -> None:
        model_path = self.model_config.get("local_path") or self.model_config.path
        placement = {}
        if self.resource_pool is not None:  # standalone: the server sits in the replica's own pool
            group = self.resource_pool.get_placement_groups()[0]
            placement = {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)}
        server = (
            ray.remote(CpuPolicyServer)
            .options(name=server_name(self.replica_rank), num_cpus=0, max_concurrency=self.max_concurrency, **placement)
            .remote(str(model_path), str(self.model_config.path), self.replica_rank)
        )
        self.servers = [server]
        self._server_handle = server
        self._server_address = await server.address.remote()

    async def init_colocated(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"rollout {NAME!r} runs in verl's hybrid and standalone modes, not colocated in the trainer's pool"
        )

    init_hybrid_colocated = init_colocated


class CpuServerAdapter(BaseRollout):
    """A replica rank's server adapter: hands the weights verl sends it to its replica's server.

    ``replica_rank`` is given by verl's ``CheckpointEngineWorker`` (standalone mode); in a training
    rank (hybrid mode) it follows from the rank, as verl's vLLM adapter derives it."""

    def __init__(
        self, config: Any, model_config: Any, device_mesh: Any, *args: Any, replica_rank: int = -1, **kwargs: Any
    ):
        super().__init__(config, model_config, device_mesh)
        replica_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = int(os.environ.get("RANK", 0))  # the rank in verl's worker group
        self.replica_rank = replica_rank if replica_rank >= 0 else rank // replica_size
        self.is_leader_rank = rank % replica_size == 0

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise UsageError(f"rollout {NAME!r} takes full weights (wire format 'named_tensors'), got {wire_format!r}")
        state = {}
        async for name, tensor in ensure_async_iterator(weights):  # every rank drains the stream
            state[name] = tensor.detach().to("cpu", copy=True)
        if not self.is_leader_rank:
            return
        version = int(kwargs.get("global_steps") or 0)
        server = ray.get_actor(server_name(self.replica_rank))
        peft_config = kwargs.get("peft_config")
        if peft_config is not None and kwargs.get("base_sync_done", True) and any(map(is_adapter, state)):
            await server.load_adapters.remote(state, lora_scale(peft_config), version)
        else:
            await server.load_weights.remote(state, version)
