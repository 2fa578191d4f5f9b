"""The patches of verl 0.9.1 that CPU mode needs, each replacing one verl call (listed in docs/verl-backend.md).

Applied by :func:`apply` in CPU processes only (``VERL_PLATFORM=cpu``), once; :data:`APPLIED` names them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CPU_BACKEND = "cpu:gloo"
APPLIED: list[str] = []


def gloo_process_group(original: Callable[..., Any]) -> Callable[..., Any]:
    """``verl.utils.distributed.initialize_global_process_group_ray`` with ``backend="cpu:gloo"`` by
    default: verl builds ``f"cpu:gloo,{device}:{backend}"``, which on CPU is ``cpu:gloo,cpu:gloo`` and
    torch refuses (``ValueError: Duplicate device type cpu in backend string: gloo``)."""

    def initialize_global_process_group_ray(timeout_second: Any = None, backend: str | None = None) -> Any:
        return original(timeout_second=timeout_second, backend=backend or CPU_BACKEND)

    initialize_global_process_group_ray._agl_patch = True  # type: ignore[attr-defined]
    return initialize_global_process_group_ray


def apply() -> None:
    """Apply every patch (idempotent)."""
    from verl.utils import distributed
    from verl.workers import engine_workers

    if not getattr(distributed.initialize_global_process_group_ray, "_agl_patch", False):
        patched = gloo_process_group(distributed.initialize_global_process_group_ray)
        distributed.initialize_global_process_group_ray = patched
        engine_workers.initialize_global_process_group_ray = patched  # imported by name there
        APPLIED.append("verl.utils.distributed.initialize_global_process_group_ray")
