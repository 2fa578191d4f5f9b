"""The ``agl`` entry point ``trl``: registers backend ``trl``. Registering imports neither TRL nor
torch; a run's config loads TRL's ``GRPOConfig`` to check its ``trl`` section, and the backend the rest."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agl_backend_trl.config import check_trl_config, load_trl_config
from agl_core import Backend, BackendSpec, Register, hookimpl

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_core import PluginManager

__all__ = ["agl_register_backends", "trl_backend"]


def trl_backend(config: DictConfig, plugins: PluginManager) -> Backend:
    """The backend for a config built by :func:`~agl_backend_trl.config.load_trl_config`
    (:class:`agl_backend_trl.backend.TrlBackend`)."""
    from agl_backend_trl.backend import TrlBackend

    return TrlBackend(config, plugins)


@hookimpl
def agl_register_backends(register: Register) -> None:
    register("trl", BackendSpec(trl_backend, load_config=load_trl_config, check_config=check_trl_config))
