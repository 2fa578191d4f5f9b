"""Agent Lightning v1.0's ``RolloutHooks`` API, and the adapter that makes such a class an agl plugin.

A v1.0 hook file (``from agentlightning.hooks import RolloutHooks`` and one subclass overriding
``on_startup / on_enqueue / on_succeeded / on_failed``) works unchanged: the loader resolves that
import to this module (and ``agentlightning.schemas`` to :mod:`agl_hooks.schemas`) when Agent
Lightning itself is not installed, and :class:`RolloutHooksPlugin` translates between agl's data
model and the objects v1.0 hooks receive. Those are Agent Lightning's own pydantic models
(``agentlightning.schemas``) when it is installed, so ``isinstance``, ``model_dump_json`` and
``model_validate`` behave as under v1.0; otherwise agl's stand-ins (:mod:`agl_hooks.schemas`: v1.0's
models, with their attribute access, ``model_copy`` and ``model_dump``).
"""

from __future__ import annotations

import copy
import importlib.util
import types
from collections.abc import Mapping
from functools import cache
from typing import Any, Protocol

import attrs

from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.errors import UsageTypeError
from agl_core.fields import thaw
from agl_core.hookspecs import hookimpl
from agl_core.plugins.event_writer import EventWriter
from agl_hooks import schemas
from agl_hooks.schemas import Event, Rollout, RolloutCreate

__all__ = [
    "HOOK_METHODS",
    "RolloutCreate",
    "RolloutHooks",
    "RolloutHooksPlugin",
    "TraceWriter",
    "is_rollout_hooks_base",
    "overridden_methods",
    "rollout_view",
    "v1_models",
]

HOOK_METHODS = ("on_startup", "on_enqueue", "on_succeeded", "on_failed")


class TraceWriter(Protocol):
    def add_event(self, rollout_id: str, attempt_id: str, event_type: str, data: dict[str, Any]) -> Any: ...


class RolloutHooks:
    """Base class of Agent Lightning v1.0 hook files; override any of the four methods."""

    def on_startup(self, store: Any | None = None) -> None:
        """Called once before the first rollout is enqueued."""

    def on_enqueue(self, request: RolloutCreate) -> RolloutCreate:
        """Return the (possibly rewritten) request."""
        return request

    def on_succeeded(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        """Called after a rollout succeeded; ``store.add_event`` appends events."""

    def on_failed(self, rollout: Rollout, store: TraceWriter) -> None:
        """Called after a rollout failed."""


# Where each ``RolloutHooks`` base class lives: agl's (this module) and Agent Lightning's own.
_BASE_MODULES = (__name__, "agentlightning.hooks")


def is_rollout_hooks_base(cls: type) -> bool:
    """Whether ``cls`` is a ``RolloutHooks`` base class (agl's or Agent Lightning's), not a user's subclass."""
    return cls.__name__ == "RolloutHooks" and cls.__module__ in _BASE_MODULES


def overridden_methods(cls: type) -> tuple[str, ...]:
    """The hook methods ``cls`` (or a class between it and its base) defines, whichever base it derives from."""
    definer = {method: next((c for c in cls.__mro__ if method in vars(c)), None) for method in HOOK_METHODS}
    return tuple(m for m, c in definer.items() if c is not None and not is_rollout_hooks_base(c))


@cache
def v1_models() -> types.ModuleType:
    """The module whose models hooks receive: ``agentlightning.schemas`` when Agent Lightning is
    installed (its pydantic models), else agl's stand-ins (:mod:`agl_hooks.schemas`)."""
    if importlib.util.find_spec("agentlightning") is not None:
        return importlib.import_module("agentlightning.schemas")
    return schemas


def _plain(value: Any) -> Any:
    return copy.deepcopy(thaw(value))


def rollout_view(rollout: CompletedRollout) -> Rollout:
    """v1.0's ``Rollout`` of a finished rollout. v1.0's status requires both its times: a rollout whose
    queue or end time agl did not see gets the other one (0.0 when neither is known)."""
    models = v1_models()
    times = [t for t in (rollout.queued_at, rollout.ended_at) if t is not None] or [0.0]
    return models.Rollout(
        rollout_id=rollout.rollout_id,
        input=_plain(rollout.input),
        is_train=rollout.is_train,
        config=_plain(rollout.config),
        metadata=_plain(rollout.metadata),
        status=models.RolloutLifecycleStatus(
            state=rollout.state,
            error_message=rollout.error,
            last_attempt_id=rollout.attempt_id,
            created_at=times[0],
            updated_at=times[-1],
        ),
    )


def _event_view(rollout_id: str, attempt_id: str, event: dict[str, Any]) -> Event:
    return v1_models().Event(
        event_type=event.get("event_type", ""),
        rollout_id=event.get("rollout_id", rollout_id),
        attempt_id=event.get("attempt_id", attempt_id),
        timestamp=event.get("timestamp", 0.0),
        data=copy.deepcopy(event.get("data", {})),
    )


class RolloutHooksPlugin:
    """Adapts one v1.0 ``RolloutHooks`` instance to agl's lifecycle hookspecs.

    Only the methods the class overrides become hook implementations (pluggy skips an attribute that
    is not callable), so a class without ``on_enqueue`` does not count as a plugin that may rewrite
    requests, and the dataset check still runs.
    """

    def __init__(self, hooks: RolloutHooks):
        self.hooks = hooks
        overridden = overridden_methods(type(hooks))
        for method in HOOK_METHODS:
            if method not in overridden:
                setattr(self, f"agl_{method}", None)

    def __repr__(self) -> str:
        return f"RolloutHooksPlugin({type(self.hooks).__name__})"

    @hookimpl
    def agl_on_startup(self) -> None:
        self.hooks.on_startup()

    @hookimpl
    def agl_on_enqueue(self, request: RolloutRequest) -> RolloutRequest:
        view = v1_models().RolloutCreate(
            input=_plain(request.input),
            is_train=request.is_train,
            config=_plain(request.config),
            metadata=_plain(request.metadata),
            rollout_id=request.rollout_id,
        )
        result = self.hooks.on_enqueue(view)
        if result is None:
            raise UsageTypeError(f"{type(self.hooks).__name__}.on_enqueue returned None; it must return the request")
        return attrs.evolve(
            request,
            rollout_id=request.rollout_id
            if result.rollout_id is None
            else result.rollout_id,  # a change is undone and counted
            input=result.input,
            is_train=bool(result.is_train),
            config=_as_dict(result.config),
            metadata=_as_dict(result.metadata),
        )

    @hookimpl
    def agl_on_succeeded(
        self, rollout: CompletedRollout, events: dict[str, list[dict[str, Any]]], writer: EventWriter
    ) -> None:
        views = {aid: [_event_view(rollout.rollout_id, aid, e) for e in evs] for aid, evs in events.items()}
        self.hooks.on_succeeded(rollout_view(rollout), views, writer)

    @hookimpl
    def agl_on_failed(self, rollout: CompletedRollout, writer: EventWriter) -> None:
        self.hooks.on_failed(rollout_view(rollout), writer)


def _as_dict(value: Any) -> dict[str, Any]:
    """A plain dict of what a hook returned as ``config`` / ``metadata``: one of agl's views (a dict: only
    the keys set), a pydantic model of Agent Lightning itself (only the fields set, as with agl's
    views), a mapping, or None."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return thaw(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_unset=True)
    return dict(value)
