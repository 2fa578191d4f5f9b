"""Where the CPU rollout replica's server listens, and the address the gateway registers for it.

Agents reach a replica through the gateway's proxy, so the address registered must be one the
gateway can reach, which ``127.0.0.1`` is only when the replica runs on the gateway's machine.
``agentlightning.verl.replica_bind_host`` is the interface the server listens on (``127.0.0.1``,
``0.0.0.0`` for every interface, or one IPv4 address of the node); ``replica_advertise_host`` is the
host registered (null: the bind host, or for a wildcard bind the node's address as Ray knows it).
The driver sends both to the Ray workers as environment variables (:func:`replica_hosts_env`):
the server actor, on whichever node Ray places it, reads them there.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import OmegaConf

BIND_ENV = "AGL_REPLICA_BIND_HOST"
ADVERTISE_ENV = "AGL_REPLICA_ADVERTISE_HOST"
BIND_KEY = "agentlightning.verl.replica_bind_host"
ADVERTISE_KEY = "agentlightning.verl.replica_advertise_host"
DEFAULT_BIND = "127.0.0.1"
EVERY_INTERFACE = "0.0.0.0"

__all__ = ["advertised_address", "bind_host", "replica_hosts_env"]


def replica_hosts_env(config: Any) -> dict[str, str]:
    """The workers' environment for the two keys (an unset advertise host is left out)."""
    env = {BIND_ENV: str(OmegaConf.select(config, BIND_KEY, default=DEFAULT_BIND) or DEFAULT_BIND)}
    advertise = OmegaConf.select(config, ADVERTISE_KEY, default=None)
    if advertise:
        env[ADVERTISE_ENV] = str(advertise)
    return env


def bind_host() -> str:
    """The interface this process's replica server listens on."""
    return os.environ.get(BIND_ENV) or DEFAULT_BIND


def advertised_address(port: int) -> str:
    """``HOST:PORT`` of this process's replica server as the gateway must reach it."""
    host = os.environ.get(ADVERTISE_ENV) or bind_host()
    if host == EVERY_INTERFACE:
        import ray

        host = ray.util.get_node_ip_address()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
