"""The ``agl`` entry point of this distribution: registers backend ``verl``."""

from __future__ import annotations

from typing import Any

from agl_backend_verl.config import check_verl_requirements, load_verl_config
from agl_core import hookimpl


def verl_backend(config: Any, plugins: Any) -> Any:
    """The verl backend for a config built by :func:`load_verl_config` (see :class:`agl_backend_verl.run.VerlBackend`)."""
    from agl_backend_verl.run import VerlBackend

    return VerlBackend(config, plugins)


# ``agl train`` validates a verl run against verl's full config, not the core schema.
verl_backend.load_config = load_verl_config  # type: ignore[attr-defined]
verl_backend.check_config = check_verl_requirements  # type: ignore[attr-defined]


@hookimpl
def agl_register_backends(register: Any) -> None:
    register("verl", verl_backend)
