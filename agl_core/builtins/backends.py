"""The built-in backend ``torch`` (plugin ``torch``): the reference backend of :mod:`agl_core.backends.torch`.

``agl check`` runs its :func:`~agl_core.backends.torch.backend.check_torch_config`; ``agl train``
builds a :class:`~agl_core.backends.torch.TorchBackend`. ``agl-backend-verl`` registers ``verl``
the same way, from its own distribution.
"""

from __future__ import annotations

from agl_core.backends.contract import BackendSpec
from agl_core.backends.torch.backend import TorchBackend, check_torch_config
from agl_core.hookspecs import Register, hookimpl

__all__ = ["agl_register_backends"]


@hookimpl
def agl_register_backends(register: Register) -> None:
    register("torch", BackendSpec(TorchBackend, check_config=check_torch_config))
