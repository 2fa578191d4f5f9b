"""Starting Ray for a run, or joining a running cluster of several nodes.

With ``ray_kwargs.ray_init.address`` (or ``RAY_ADDRESS``) naming a cluster (``HOST:PORT`` of its
head, or ``auto`` for one started on this machine), agl joins it instead of starting a Ray of its
own. A cluster brings its nodes' resources, so the arguments that size a new Ray (``num_cpus``,
``num_gpus``, ``resources``...; CPU mode sets some) are left out, and the log says which. Before
joining, the address is checked to answer as a Ray cluster's GCS (a gRPC server) within
``agentlightning.verl.ray_connect_timeout_seconds``: Ray itself keeps retrying an address where
nothing listens, or where another service does, for minutes before it fails.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import ray

from agl_backend_verl.config import NEW_RAY_ONLY, RAY_ADDRESS_KEY, is_ray_address
from agl_backend_verl.ray_errors import RayUnreachable

logger = logging.getLogger(__name__)

ADDRESS_ENV = "RAY_ADDRESS"

__all__ = ["ADDRESS_ENV", "check_reachable", "cluster_address", "start_or_join"]


def cluster_address(kwargs: dict[str, Any]) -> str | None:
    """The cluster ``ray.init(**kwargs)`` joins: its ``address``, else ``RAY_ADDRESS``; None (or
    ``local``) starts a new Ray."""
    address = kwargs.get("address") or os.environ.get(ADDRESS_ENV) or None
    return None if address == "local" else address


def check_reachable(address: str, timeout: float) -> None:
    """Raise :class:`RayUnreachable` unless a Ray cluster's GCS answers at ``address`` (``HOST:PORT``)
    within ``timeout`` seconds: something must accept a connection there and answer the HTTP/2
    preface as a gRPC server does (Ray's dashboard, or any HTTP/1 server, does not). ``auto`` and
    ``ray://`` URLs are Ray's to resolve; any other URL is refused."""
    if address == "auto" or address.startswith("ray://"):
        return
    where = f"{address} ({RAY_ADDRESS_KEY} or {ADDRESS_ENV})"
    if not is_ray_address(address):
        raise RayUnreachable(
            f"{where} is not a Ray cluster's address: Ray joins HOST:PORT of its head's GCS (port 6379 unless "
            "`ray start --head --port` chose another), auto, or a ray:// URL; an http:// URL such as the "
            "dashboard's (port 8265) is none of them"
        )
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as connection:
            connection.settimeout(timeout)
            connection.sendall(_HTTP2_PREFACE)
            reply = connection.recv(9)
    except OSError as exc:
        raise RayUnreachable(f"no Ray cluster answers at {where} within {timeout:g} s: {exc}") from None
    if len(reply) < 9 or reply[3] != _SETTINGS_FRAME:
        raise RayUnreachable(
            f"something listens at {where}, but it is not a Ray cluster's GCS (it did not answer as a gRPC "
            f"server; it answered {reply!r}): is it Ray's dashboard or another service?"
        )


# A client's HTTP/2 connection preface and an empty SETTINGS frame; a gRPC server answers with its own
# SETTINGS frame (a 9-byte header whose fourth byte is the frame type, 4).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_SETTINGS_FRAME = 0x04


def start_or_join(kwargs: dict[str, Any], connect_timeout: float) -> None:
    """``ray.init(**kwargs)``, joining the cluster at :func:`cluster_address` when there is one (checked
    to answer as a Ray cluster within ``connect_timeout`` seconds first)."""
    address = cluster_address(kwargs)
    if address is not None:
        dropped = sorted(key for key in NEW_RAY_ONLY if kwargs.get(key) is not None)
        if dropped:
            logger.info(
                "joining the Ray cluster at %s: its nodes' resources apply, not %s", address, ", ".join(dropped)
            )
        kwargs = {key: value for key, value in kwargs.items() if key not in NEW_RAY_ONLY}
        check_reachable(address, connect_timeout)
    ray.init(**kwargs)
