"""The processes of ``tests/verl/test_cpu_checkpoint_engine.py``: each plays one rank of verl's weight
sync with :class:`~agl_backend_verl.cpu.checkpoint_engine.GlooCheckpointEngine`, and the test process
does what verl's ``CheckpointEngineManager.update_weights`` does between them (collect ``prepare``,
``build_topology``, hand each rank its arguments)."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import torch

BUCKET_BYTES = 64  # small enough for several buckets and for a tensor split across buckets


def weights(version: int) -> dict[str, torch.Tensor]:
    """The actor's weights at ``version``: mixed dtypes, odd byte counts, one tensor wider than a bucket."""
    g = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(3, 5, generator=g),
        "norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: the next tensor is misaligned
        "layer.weight": torch.randn(40, generator=g, dtype=torch.float64),  # 320 bytes: chunked over 5 buckets
        "positions": torch.arange(version, version + 5),
        "scalar": torch.tensor(float(version)),
    }


def play(role: str, versions: list[int], inbox: Any, outbox: Any) -> None:
    """Play ``role`` (``source``: actor rank 0; ``drain``: another actor rank; ``receiver``: a rollout
    worker) for one weight update per version; a receiver reports what it received."""
    from agl_backend_verl.cpu.checkpoint_engine import GlooCheckpointEngine

    torch.set_num_threads(1)
    engine = GlooCheckpointEngine(BUCKET_BYTES, is_master=role == "source")
    for version in versions:
        outbox.put(("prepared", engine.prepare()))
        engine.init_process_group(**inbox.get())
        if role == "receiver":
            received = asyncio.run(_collect(engine.receive_weights(global_steps=version)))
            # By value: a tensor put on a queue as it is travels as a file descriptor that the test
            # process can only open while this process lives, and this one may have exited by then.
            outbox.put(("received", pickle.dumps(received)))
        else:
            drained: list[str] = []
            asyncio.run(engine.send_weights(_tracked(weights(version), drained), global_steps=version))
            outbox.put(("sent", drained))
        engine.finalize()


async def _collect(stream: Any) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor) async for name, tensor in stream]


def _tracked(state: dict[str, torch.Tensor], drained: list[str]):
    """``state`` as verl's per-tensor generator, noting each name as it is taken (FSDP gathers it then)."""
    for name, tensor in state.items():
        drained.append(name)
        yield name, tensor
