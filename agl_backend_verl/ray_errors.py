"""Ray's own failures, told as Ray's.

Backend ``verl`` runs on a Ray cluster. When Ray itself fails — its node does not start, nothing
answers at the cluster's address, a node is lost, a worker process dies — the error is Ray's, not a
bug in agl. :func:`ray_failures_explained` turns such an exception into a :class:`RayFailure`: an
:class:`~agl_core.AglError`, so ``agl`` prints one ``agl: error:`` line that names Ray and what was
lost, and an ``agl: hint:`` line with the setting that governs it and what to do. Any other
exception passes through unchanged.

An exception raised in a Ray actor reaches the driver as a ``RayTaskError``: the failure it wraps
(the exception object, or where it was re-raised as another type, the Ray error its traceback
names) is the one explained.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import ClassVar

import ray
from ray import exceptions as ray_exceptions

from agl_backend_verl.config import RAY_ADDRESS_KEY
from agl_core import AglError

RESUME = "run agl train again once the cluster is whole: trainer.resume_mode=auto continues from the last checkpoint"

__all__ = [
    "RayFailure",
    "RayNodeLost",
    "RayStartTimeout",
    "RayUnreachable",
    "RayWorkerDied",
    "explain_ray_failure",
    "nodes_watched",
    "ray_failures_explained",
]


class RayFailure(AglError, RuntimeError):
    """Ray failed (not agl): the message says what Ray lost; :attr:`hint` what to do about it."""


class RayStartTimeout(RayFailure):
    """Ray's local node did not start in time (its processes start slowly on a loaded machine)."""

    hint: ClassVar[str | None] = (
        "Ray 2.60 waits 15 s for its agent processes and 30 s for the node to register, and has no setting for "
        "either (RAY_raylet_start_wait_time_s lengthens only Ray's lookup of the node): start Ray before agl "
        f"(`ray start --head`, again if it times out) and join it with {RAY_ADDRESS_KEY}=HOST:PORT (or RAY_ADDRESS), "
        "or train when the machine is less loaded"
    )


class RayUnreachable(RayFailure):
    """No Ray cluster answers at the address agl was told to join."""

    hint: ClassVar[str | None] = (
        f"start the cluster there (`ray start --head --port=PORT`) or fix {RAY_ADDRESS_KEY} (RAY_ADDRESS sets it "
        "too); with neither set, agl starts a Ray of its own"
    )


class RayNodeLost(RayFailure):
    """A node of the Ray cluster died or became unreachable while the run used it."""

    hint: ClassVar[str | None] = (
        "`ray status` lists the cluster's nodes; Ray declares a node dead after RAY_health_check_failure_threshold "
        f"missed health checks, RAY_health_check_period_ms apart; {RESUME}"
    )


class RayWorkerDied(RayFailure):
    """A Ray worker process (an actor of the run) died: killed, out of memory, or crashed."""

    hint: ClassVar[str | None] = (
        "its own log is in the Ray session's logs folder (worker-*.err; /tmp/ray/session_latest/logs by default); "
        "Ray's memory monitor kills workers above RAY_memory_usage_threshold of the node's memory, the kernel's "
        f"OOM killer shows in dmesg; {RESUME}"
    )


# Ray errors a traceback may name when an actor re-raised one as another type (the object is then lost).
NAMED_IN_TRACEBACK = re.compile(
    r"ray\.exceptions\.(ActorDiedError|ActorUnavailableError|RayActorError|NodeDiedError|WorkerCrashedError|"
    r"LocalRayletDiedError|OutOfMemoryError|ObjectLostError|OwnerDiedError|ObjectReconstructionFailedError)"
    r": (.+)"
)
NODE_DIED = re.compile(r"node (has )?died|node .* (was|is|has been) (marked )?dead|raylet .*died|NodeDiedError", re.I)
WORKER_LOST = (
    ray_exceptions.WorkerCrashedError,
    ray_exceptions.LocalRayletDiedError,
    ray_exceptions.OutOfMemoryError,
    ray_exceptions.ObjectLostError,
)
START_TIMEOUT = "The current node timed out during startup"
UNREACHABLE = ("Failed to connect to Ray cluster", "Could not find any running Ray instance")


def _field(message: str, name: str) -> str | None:
    match = re.search(rf"^\s*{name}: (.+)$", message, re.M)
    return match.group(1).strip() if match else None


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _actor_gist(message: str) -> str:
    """What an actor error says in one line: which actor, where, and Ray's reason (first sentence)."""
    who = (_field(message, "class_name") or "").rpartition(".")[2]  # a qualified name's last part
    pid, ip = _field(message, "pid"), _field(message, "ip")
    reasons = [line for line in message.splitlines()[1:] if line.strip() and not line.startswith("\t")]
    reason = _first_sentence(reasons[0]) if reasons else _first_sentence(message.splitlines()[0])
    where = ", ".join(part for part in (f"pid {pid}" if pid else "", f"node {ip}" if ip else "") if part)
    actor = f"actor {who}" + (f" ({where})" if where else "") if who else "an actor"
    return f"{actor}: {reason}"


def _wrapped(exc: BaseException) -> BaseException:
    """The failure inside a ``RayTaskError`` (raised in an actor), else ``exc`` itself."""
    if isinstance(exc, ray_exceptions.RayTaskError) and isinstance(exc.cause, BaseException):
        return exc.cause
    return exc


def _explain_ray_error(kind: type[BaseException], message: str) -> RayFailure | None:
    """The failure a Ray error of class ``kind`` with ``message`` stands for (None: not a lost node or worker)."""
    actor = issubclass(kind, ray_exceptions.RayActorError)
    if issubclass(kind, ray_exceptions.NodeDiedError) or (
        (actor or issubclass(kind, ray_exceptions.ObjectLostError)) and NODE_DIED.search(message)
    ):
        return RayNodeLost(
            f"Ray lost a node of the cluster: {_actor_gist(message) if actor else _first_sentence(message)}"
        )
    if issubclass(kind, ray_exceptions.ActorUnavailableError):
        return RayWorkerDied(f"a Ray actor became unreachable (its process or its node is gone): {message}")
    if actor:
        return RayWorkerDied(f"a Ray worker process died: {_actor_gist(message)}")
    if issubclass(kind, WORKER_LOST):
        return RayWorkerDied(f"a Ray worker process died ({kind.__name__}): {_first_sentence(message)}")
    return None


def explain_ray_failure(exc: BaseException, address: str | None = None) -> RayFailure | None:
    """The :class:`RayFailure` that says what Ray lost in ``exc``, or None when ``exc`` is not Ray's
    own failure (an error of agl, verl or a plugin, even one raised inside a Ray actor).
    ``address`` is the cluster address agl was given, if any."""
    if isinstance(exc, RayFailure):
        return exc
    inner = _wrapped(exc)
    message = str(inner)
    if isinstance(inner, ray_exceptions.RayError) and not isinstance(inner, ray_exceptions.RayTaskError):
        return _explain_ray_error(type(inner), message)
    if isinstance(exc, ray_exceptions.RayTaskError):
        named = NAMED_IN_TRACEBACK.search(str(exc))  # an actor re-raised a Ray error as another type
        return None if named is None else _explain_ray_error(getattr(ray_exceptions, named.group(1)), named.group(2))
    if message.startswith(START_TIMEOUT):
        return RayStartTimeout(f"Ray did not start: {_first_sentence(message)}")
    if isinstance(exc, ConnectionError) and message.startswith(UNREACHABLE):
        where = address or "the address Ray looked for (RAY_ADDRESS, or a cluster started on this machine)"
        return RayUnreachable(f"no Ray cluster answers at {where}: {_first_sentence(message)}")
    return None


@contextlib.contextmanager
def ray_failures_explained(address: str | None = None) -> Iterator[None]:
    """Raise Ray's own failures in the block as :class:`RayFailure` (:func:`explain_ray_failure`),
    chained to the original; anything else unchanged."""
    try:
        yield
    except Exception as exc:
        failure = explain_ray_failure(exc, address)
        if failure is None or failure is exc:
            raise
        raise failure from exc


# What a process says when the peer of a collective or a connection went away with its node (gloo,
# NCCL, sockets): the node's death may reach Ray's GCS only after its health checks run out.
LOST_PEER = re.compile(
    r"closed by peer|reset by peer|connection refused|remote process exited|broken pipe|socket closed", re.I
)
LOST_NODE_WAIT_S = 60.0  # beyond Ray's default health checks (5 missed, 3 s apart, 10 s timeout each)


def _alive_nodes() -> dict[str, str]:
    """Node id -> address of the cluster's live nodes."""
    return {node["NodeID"]: node.get("NodeManagerAddress", "?") for node in ray.nodes() if node.get("Alive")}


def lost_nodes(
    alive_before: dict[str, str], wait_s: float, nodes: Callable[[], dict[str, str]] = _alive_nodes
) -> list[str]:
    """``address (id)`` of each node of ``alive_before`` that is no longer alive, asking Ray again for up
    to ``wait_s`` seconds while none is."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = nodes()
        lost = [f"{address} ({node_id[:12]})" for node_id, address in alive_before.items() if node_id not in alive]
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(1.0)


@contextlib.contextmanager
def nodes_watched(nodes: Callable[[], dict[str, str]] = _alive_nodes) -> Iterator[None]:
    """Inside a running Ray session: an error that is not agl's, raised while a node that was alive on
    entry died, is raised as :class:`RayNodeLost` naming the node and what failed first (a surviving
    rank's collective, a call to a replica there...), chained to it. Where the error reads as a lost
    peer (:data:`LOST_PEER`), Ray is asked for up to :data:`LOST_NODE_WAIT_S` seconds, the time its
    health checks take to declare the node dead."""
    alive_before = nodes()
    try:
        yield
    except AglError:
        raise
    except Exception as exc:
        inner = _wrapped(exc)
        first = " ".join(str(inner).split())[:300]
        wait_s = LOST_NODE_WAIT_S if LOST_PEER.search(f"{exc}\n{first}") else 0.0
        lost = lost_nodes(alive_before, wait_s, nodes)
        if not lost:
            raise
        raise RayNodeLost(
            f"Ray lost a node of the cluster while the run used it: {', '.join(lost)}; what failed first: "
            f"{type(inner).__name__}: {first}"
        ) from exc
