"""The built-in backend ``torch`` (plugin ``torch``): the reference backend of :mod:`agl_core.backends.torch`.

``agl check`` runs its :func:`~agl_core.backends.torch.checks.check_torch_config`; ``agl train``
builds a :class:`~agl_core.backends.torch.backend.TorchBackend`. Registering it imports neither
torch nor the backend (``agl plugins`` and ``agl check`` never need them). ``agl-backend-verl``
registers ``verl`` the same way, from its own distribution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agl_core.backends.contract import BackendSpec
from agl_core.backends.torch.checks import check_torch_config
from agl_core.hookspecs import Register, hookimpl

if TYPE_CHECKING:
    from agl_core.backends.contract import Backend
    from agl_core.plugins import PluginManager

__all__ = ["agl_register_backends", "torch_backend"]


def torch_backend(config: Any, plugins: PluginManager) -> Backend:
    """The torch backend for ``config`` (see :class:`agl_core.backends.torch.backend.TorchBackend`)."""
    from agl_core.backends.torch.backend import TorchBackend

    return TorchBackend(config, plugins)


@hookimpl
def agl_register_backends(register: Register) -> None:
    register("torch", BackendSpec(torch_backend, check_config=check_torch_config))
