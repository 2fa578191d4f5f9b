"""A checkpoint engine for verl's CPU mode: the actor's weights broadcast to standalone rollout workers over gloo.

verl's separate_async trainer pushes weights to its standalone rollout replicas through a checkpoint
engine from ``verl.checkpoint_engine.CheckpointEngineRegistry`` (``actor_rollout_ref.rollout.
checkpoint_engine.backend``); the ones verl ships need GPUs (``nccl``, ``hccl``) or RDMA transports
(``nixl``, ``mooncake``, ``kimi``), and ``naive`` only serves a rollout inside the trainer's own ranks.
:class:`GlooCheckpointEngine` is registered as :data:`BACKEND`, and speaks verl's protocol
(``prepare`` → ``build_topology`` → ``init_process_group`` → ``send_weights`` / ``receive_weights``
→ ``finalize``, driven by ``CheckpointEngineManager.update_weights``):

- actor rank 0 is the source: it hosts a ``TCPStore`` for the update and is rank 0 of a
  ``ProcessGroupGloo`` built on it, whose other ranks are the rollout workers. It is a group of its
  own, apart from torch's default group, which each side already uses for its own ranks;
- the other actor ranks join nothing but still walk their weight generator (FSDP gathers every
  full tensor collectively);
- the weights travel in buckets of at most ``bucket_size`` bytes (verl's ``split_weight_chunks``,
  reassembled by ``merge_weight_chunks``): per bucket, one broadcast of its two sizes, then one of a
  JSON header (each tensor's name, dtype, shape and place) followed by the bytes, each tensor
  at an offset aligned to :data:`ALIGNMENT` bytes.

A new group is built for every update and dropped by ``finalize``, so replicas may come and go.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    TensorMeta,
    merge_weight_chunks,
    split_weight_chunks,
)
from verl.workers.rollout.utils import ensure_async_iterator

from agl_core import UsageError

__all__ = ["BACKEND", "GlooCheckpointEngine", "Rendezvous"]

BACKEND = "agl_gloo"
SOURCE = 0  # the group rank of actor rank 0
NOT_IN_GROUP = -1  # the group rank of the other actor ranks
ALIGNMENT = 8  # bytes: every tensor starts at a multiple of the widest element size
TIMEOUT = timedelta(minutes=10)  # how long a rank waits for the others to join or to send


@dataclass(frozen=True)
class Rendezvous:
    """Where the update's group meets: the source's ``TCPStore``."""

    host: str
    port: int


class GlooCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine over a gloo process group (see the module docstring).

    verl builds one in each actor rank (``is_master`` on rank 0) and one in each rollout worker."""

    def __init__(self, bucket_size: int, is_master: bool = False) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rank = NOT_IN_GROUP
        self.group: ProcessGroupGloo | None = None
        self._store: TCPStore | None = None

    # -- the group ------------------------------------------------------------------------------

    def prepare(self) -> Rendezvous | None:
        """On the source: open the update's ``TCPStore`` on a free port; its address goes to every rank."""
        if not self.is_master:
            return None
        host = _node_ip()
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        return Rendezvous(host, self._store.port)

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor rank 0 is group rank 0, the rollout workers are ranks 1..n, the other actor ranks stay out."""
        rendezvous = metadata[0]
        if not isinstance(rendezvous, Rendezvous):
            raise UsageError(f"actor rank 0 must be checkpoint engine {BACKEND!r}'s source, got {rendezvous!r}")
        world_size = 1 + rollout_world_size
        actor = {
            "rank": [SOURCE] + [NOT_IN_GROUP] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            "rendezvous": [rendezvous] * actor_wg_world_size,
        }
        rollout = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "rendezvous": [rendezvous] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, rendezvous: Rendezvous) -> None:
        """Join the update's group (blocks until all ``world_size`` ranks have joined)."""
        self.rank = rank
        if rank == NOT_IN_GROUP:
            return
        store = self._store or TCPStore(rendezvous.host, rendezvous.port, is_master=False, timeout=TIMEOUT)
        self.group = ProcessGroupGloo(PrefixStore(BACKEND, store), rank, world_size, TIMEOUT)
        self._store = store

    def finalize(self) -> None:
        self.group = None
        self._store = None
        self.rank = NOT_IN_GROUP

    # -- the weights ----------------------------------------------------------------------------

    @torch.no_grad()
    async def send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]], global_steps=None
    ) -> dict[str, float]:
        """Broadcast ``weights`` from the source; every other actor rank only drains them."""
        if self.rank == NOT_IN_GROUP:
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        if self.rank != SOURCE:
            raise RuntimeError(f"rollout workers receive weights; rank {self.rank} was asked to send")
        bucket: list[tuple[TensorMeta, torch.Tensor]] = []
        filled = 0
        async for meta, chunk in split_weight_chunks(weights, self.bucket_size):
            if bucket and _aligned(filled) + meta.chunk_size > self.bucket_size:
                self._send_bucket(bucket, is_last=False)
                bucket, filled = [], 0
            meta.offset = _aligned(filled)
            bucket.append((meta, chunk))
            filled = meta.offset + meta.chunk_size
        self._send_bucket(bucket, is_last=True)
        return {}

    async def receive_weights(self, global_steps=None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """The weights the source broadcasts, as ``(name, tensor)`` pairs in its order."""
        async for name, tensor in merge_weight_chunks(self._receive_chunks(), self.bucket_size):
            yield name, tensor

    async def _receive_chunks(self) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        if self.group is None or self.rank in (SOURCE, NOT_IN_GROUP):
            raise RuntimeError(f"rank {self.rank} of checkpoint engine {BACKEND!r} receives no weights")
        is_last = False
        while not is_last:
            sizes = self._broadcast(torch.zeros(2, dtype=torch.int64))
            message = self._broadcast(torch.empty(int(sizes.sum()), dtype=torch.uint8))
            header = json.loads(message[: int(sizes[0])].numpy().tobytes())
            payload = message[int(sizes[0]) :]  # a fresh buffer per bucket: the chunks yielded stay valid
            is_last = header["is_last"]
            for meta in map(_meta, header["tensors"]):
                yield meta, payload[meta.offset : meta.offset + meta.chunk_size]

    def _send_bucket(self, bucket: list[tuple[TensorMeta, torch.Tensor]], is_last: bool) -> None:
        header = json.dumps({"is_last": is_last, "tensors": [_header(meta) for meta, _ in bucket]}).encode()
        header = header.ljust(_aligned(len(header)))  # JSON allows trailing blanks; the payload stays aligned
        size = max((meta.offset + meta.chunk_size for meta, _ in bucket), default=0)
        message = torch.zeros(len(header) + size, dtype=torch.uint8)
        message[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        payload = message[len(header) :]
        for meta, chunk in bucket:
            payload[meta.offset : meta.offset + meta.chunk_size] = chunk.reshape(-1)
        self._broadcast(torch.tensor([len(header), size], dtype=torch.int64))
        self._broadcast(message)

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        options = BroadcastOptions()
        options.rootRank = SOURCE
        self.group.broadcast([tensor], options).wait()
        return tensor


def _aligned(offset: int) -> int:
    """``offset`` rounded up to :data:`ALIGNMENT` bytes, so a chunk can be viewed as any dtype in place."""
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _header(meta: TensorMeta) -> dict[str, Any]:
    return {
        "name": meta.name,
        "shape": list(meta.shape),
        "dtype": str(meta.dtype).removeprefix("torch."),
        "chunk_offset": meta.chunk_offset,
        "chunk_size": meta.chunk_size,
        "offset": meta.offset,
    }


def _meta(entry: dict[str, Any]) -> TensorMeta:
    dtype = getattr(torch, entry["dtype"])
    return TensorMeta(**{**entry, "shape": torch.Size(entry["shape"]), "dtype": dtype})


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address().strip("[]") if ray.is_initialized() else "127.0.0.1"


def register() -> None:
    """Register :class:`GlooCheckpointEngine` as :data:`BACKEND` (verl's registry keeps the last one)."""
    CheckpointEngineRegistry.register(BACKEND)(GlooCheckpointEngine)
