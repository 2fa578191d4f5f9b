"""verl's device platform for CPU, registered in ``verl.plugin.platform.PlatformRegistry`` as ``cpu``.

verl 0.9.1 resolves its platform once per process (``VERL_PLATFORM``, else probing, else CUDA). This
platform is never probed (:meth:`CpuPlatform.is_platform_available` is false), so a GPU machine is
unaffected; ``VERL_PLATFORM=cpu`` in every Ray worker's environment selects it. Collectives run on
gloo; Ray schedules verl's ranks on the custom resource :data:`RANK_RESOURCE` (one unit per rank),
which :mod:`agl_backend_verl.cpu.mode` declares when it starts Ray.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from agl_backend_verl.cpu.mode import DEVICE as NAME
from agl_backend_verl.cpu.mode import RANK_RESOURCE


class CpuDeviceModule:
    """``torch.cpu`` with the parts of ``torch.cuda``'s interface verl calls on its device module
    (memory statistics, cache clearing, RNG state), answered as a CPU does: no device cache, no
    per-device statistics."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def _zero(*args: Any, **kwargs: Any) -> int:
        return 0

    memory_reserved = memory_allocated = max_memory_reserved = max_memory_allocated = _zero

    @staticmethod
    def _nothing(*args: Any, **kwargs: Any) -> None:
        return None

    empty_cache = ipc_collect = reset_peak_memory_stats = set_device = set_per_process_memory_fraction = _nothing

    @staticmethod
    def get_device_name(*args: Any) -> str:
        return "CPU"  # verl's FLOPs table has no CPU entry: MFU reads 0

    @staticmethod
    def mem_get_info(*args: Any) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    @staticmethod
    def get_rng_state(*args: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *args: Any) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


DEVICE_MODULE = CpuDeviceModule()


@PlatformRegistry.register(platform=NAME)
class CpuPlatform(PlatformBase):
    """The torch.cpu module, gloo, one device per process, nothing to select or synchronise."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # chosen only by name (VERL_PLATFORM=cpu), never by verl's probing

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    profiler_stop = profiler_start

    def ray_resource_name(self) -> str:
        return RANK_RESOURCE

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None
