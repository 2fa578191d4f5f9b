"""verl's CPU mode: a CPU platform, verl's FSDP engines for ``cpu``, a CPU rollout replica.

Everything goes through verl's extension points (``PlatformRegistry``, ``EngineRegistry``,
``RolloutReplicaRegistry``, the rollout table and ``CheckpointEngineRegistry``); :func:`register`
runs in every process that imports verl (from :mod:`agl_backend_verl.verl_plugins`). The config side
is :mod:`agl_backend_verl.cpu.mode`.
"""

from __future__ import annotations

import os

from agl_backend_verl.cpu.mode import (
    CPU_KEYS,
    DEVICE,
    PLATFORM_ENV,
    REPLICA,
    SEPARATE_ASYNC_CPU_KEYS,
    is_cpu,
    mode_keys,
)

# The in-rank adapter of the CPU rollout, as verl's rollout table names classes (a dotted path).
ADAPTER_CLASS = "agl_backend_verl.cpu.replica.CpuServerAdapter"

__all__ = ["CPU_KEYS", "SEPARATE_ASYNC_CPU_KEYS", "is_cpu", "mode_keys", "register"]


def register() -> None:
    """Register the CPU platform and replica with verl; in a CPU process also verl's engines for
    ``cpu``, the gloo checkpoint engine and the patches of :mod:`agl_backend_verl.cpu.patches`."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from agl_backend_verl.cpu import platform  # noqa: F401  (registers the platform on import)

    RolloutReplicaRegistry.register(REPLICA, _replica_class)
    rollout_base._ROLLOUT_REGISTRY[(REPLICA, "async")] = ADAPTER_CLASS
    if os.environ.get(PLATFORM_ENV, "").strip().lower() == DEVICE:
        from agl_backend_verl.cpu import checkpoint_engine, patches
        from agl_backend_verl.cpu.engines import register_engines

        register_engines()
        checkpoint_engine.register()
        patches.apply()


def _replica_class() -> type:
    from agl_backend_verl.cpu.replica import CpuReplica

    return CpuReplica
