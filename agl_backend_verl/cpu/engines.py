"""verl's own FSDP engines made findable for device ``cpu`` in ``verl.workers.engine.EngineRegistry``.

verl 0.9.1 registers ``FSDPEngineWithLMHead`` (actor, reference) and ``FSDPEngineWithValueHead``
(critic) for ``cuda`` and ``npu`` only; on the CPU platform the lookup fails with ``No engine
registered for device='cpu'``. The same classes are registered for ``cpu`` here, unchanged: on CPU
they need ``strategy: fsdp2`` (FSDP1 refuses CPU parameters with ``sync_module_states``), SDPA
attention and fp32 (:mod:`agl_backend_verl.cpu.mode` checks and sets those).
"""

from __future__ import annotations

from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

DEVICE = "cpu"
BACKENDS = ["fsdp", "fsdp2"]
ENGINES = {"language_model": FSDPEngineWithLMHead, "value_model": FSDPEngineWithValueHead}


def register_engines() -> None:
    """Register verl's FSDP engines for ``cpu`` (once per process; verl refuses a second registration)."""
    for model_type, engine in ENGINES.items():
        registered = EngineRegistry._engines.get(model_type, {})
        if all(DEVICE in registered.get(backend, {}) for backend in BACKENDS):
            continue
        EngineRegistry.register(model_type=model_type, backend=BACKENDS, device=DEVICE)(engine)
