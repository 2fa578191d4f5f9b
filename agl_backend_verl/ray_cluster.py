"""Starting Ray for a run, or joining a running cluster of several nodes.

With ``ray_kwargs.ray_init.address`` (or ``RAY_ADDRESS``) naming a cluster (``HOST:PORT`` of its
head, or ``auto`` for one started on this machine), agl joins it instead of starting a Ray of its
own. A cluster brings its nodes' resources, so the arguments that size a new Ray (``num_cpus``,
``num_gpus``, ``resources``...; CPU mode sets some) are left out, and the log says which. Before
joining, the address is checked with one TCP connection: Ray itself keeps retrying an address
where nothing listens for minutes before it fails.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import ray

from agl_backend_verl.config import RAY_ADDRESS_KEY
from agl_backend_verl.ray_errors import RayUnreachable

logger = logging.getLogger(__name__)

ADDRESS_ENV = "RAY_ADDRESS"
# ray.init's arguments that size a new local Ray; Ray refuses them when it joins a cluster.
NEW_RAY_ONLY = ("num_cpus", "num_gpus", "resources", "labels", "object_store_memory", "_memory", "_temp_dir")
CONNECT_TIMEOUT_S = 10.0

__all__ = ["ADDRESS_ENV", "cluster_address", "start_or_join"]


def cluster_address(kwargs: dict[str, Any]) -> str | None:
    """The cluster ``ray.init(**kwargs)`` joins: its ``address``, else ``RAY_ADDRESS``; None (or
    ``local``) starts a new Ray."""
    address = kwargs.get("address") or os.environ.get(ADDRESS_ENV) or None
    return None if address == "local" else address


def check_reachable(address: str) -> None:
    """Raise :class:`RayUnreachable` unless something listens at ``address`` (``HOST:PORT``; other
    forms, ``auto`` and ``ray://``, are Ray's to resolve)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "//" in host:
        return
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        where = f"{address} ({RAY_ADDRESS_KEY} or {ADDRESS_ENV})"
        raise RayUnreachable(f"no Ray cluster answers at {where}: {exc}") from None


def start_or_join(kwargs: dict[str, Any]) -> None:
    """``ray.init(**kwargs)``, joining the cluster at :func:`cluster_address` when there is one."""
    address = cluster_address(kwargs)
    if address is not None:
        dropped = sorted(key for key in NEW_RAY_ONLY if kwargs.get(key) is not None)
        if dropped:
            logger.info(
                "joining the Ray cluster at %s: its nodes' resources apply, not %s", address, ", ".join(dropped)
            )
        kwargs = {key: value for key, value in kwargs.items() if key not in NEW_RAY_ONLY}
        check_reachable(address)
    ray.init(**kwargs)
