"""The ``agl`` entry point of this distribution: registers backend ``verl``."""

from __future__ import annotations

from typing import Any

from agl_core import hookimpl


def verl_backend(config: Any, plugins: Any) -> Any:
    """The verl backend for a validated config (see :func:`agl_backend_verl.run.backend`)."""
    from agl_backend_verl.run import VerlBackend

    return VerlBackend(config, plugins)


@hookimpl
def agl_register_backends(register: Any) -> None:
    register("verl", verl_backend)
