"""Agent Lightning v1.0's ``agentlightning.schemas`` names, for hook files that import or read them.

v1.0's schemas are pydantic models; these stand-ins have the same names, fields and defaults, and
behave as hooks use the models: attribute access (``request.config.timeout_seconds``,
``rollout.metadata.batch_idx``, ``rollout.status.version``), ``model_copy(update=..., deep=...)``,
``model_dump()`` and ``model_dump_json()``. The two mapping-shaped models a hook most often touches,
:class:`RolloutConfig` (with its ``local`` / ``k8s`` parts) and :class:`RolloutMetadata`, are dicts
too, so item access (``metadata["key"]``, ``dict(metadata)``) works as on the plain dicts agl passed
before; a field never set reads as its v1.0 default. Where Agent Lightning is installed, hooks get
its own models instead (:func:`agl_hooks.rollout_hooks.v1_models`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from enum import Enum
from typing import Any, ClassVar

import attrs

__all__ = [
    "DEFAULT_ATTEMPT_ID",
    "TERMINAL_STATES",
    "VALID_TRANSITIONS",
    "Event",
    "EventCreate",
    "Model",
    "ModelRequestData",
    "RewardData",
    "Rollout",
    "RolloutConfig",
    "RolloutCreate",
    "RolloutK8sConfig",
    "RolloutLifecycleStatus",
    "RolloutLocalConfig",
    "RolloutMetadata",
    "RolloutPatch",
    "RolloutState",
    "RolloutStatusPatch",
]


# (str, Enum), not StrEnum: str() and format() of a member stay what Agent Lightning's hook files get.
class RolloutState(str, Enum):  # noqa: UP042
    """Rollout lifecycle states; each equals its string (``RolloutState.FAILED == "failed"``)."""

    QUEUING = "queuing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


VALID_TRANSITIONS: dict[RolloutState, set[RolloutState]] = {
    RolloutState.QUEUING: {RolloutState.RUNNING, RolloutState.FAILED},
    RolloutState.RUNNING: {RolloutState.SUCCEEDED, RolloutState.FAILED},
    RolloutState.SUCCEEDED: set(),
    RolloutState.FAILED: set(),
}
TERMINAL_STATES: frozenset[RolloutState] = frozenset({RolloutState.SUCCEEDED, RolloutState.FAILED})
DEFAULT_ATTEMPT_ID = "0"


class _ModelMethods:
    """pydantic's ``model_copy`` / ``model_dump`` / ``model_dump_json``, as v1.0 hooks call them."""

    def model_copy(self, update: Mapping[str, Any] | None = None, deep: bool = False) -> Any:
        clone = copy.deepcopy(self) if deep else copy.copy(self)
        for key, value in (update or {}).items():
            setattr(clone, key, value)
        return clone

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return _dump(self)

    def model_dump_json(self, **_: Any) -> str:
        return json.dumps(self.model_dump(), default=str)


def _dump(value: Any) -> Any:
    """Plain Python values (dicts, lists) of a model, its parts and their defaults."""
    if attrs.has(type(value)):
        return {f.name: _dump(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if isinstance(value, _Record):
        value = {**value._defaults(), **value}
    if isinstance(value, Mapping):
        return {key: _dump(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_dump(item) for item in value]
    return value


class _Record(_ModelMethods, dict):
    """A model that is also a dict of the fields set; unset fields read as their defaults."""

    FIELDS: ClassVar[dict[str, Any]] = {}  # field -> v1.0 default
    PARTS: ClassVar[dict[str, type[_Record]]] = {}  # field -> model of a nested mapping

    def __init__(self, data: Mapping[str, Any] | None = None, **fields: Any):
        super().__init__()
        for key, value in {**(data or {}), **fields}.items():
            self[key] = value

    def _defaults(self) -> dict[str, Any]:
        return copy.deepcopy(self.FIELDS)

    def __setitem__(self, key: str, value: Any) -> None:
        part = self.PARTS.get(key)
        super().__setitem__(key, part(value) if part is not None and isinstance(value, Mapping) else value)

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        if name in self.FIELDS:
            return copy.deepcopy(self.FIELDS[name])
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        del self[name]

    def __copy__(self) -> _Record:
        return type(self)(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Record:
        return type(self)(copy.deepcopy(dict(self), memo))


class RolloutLocalConfig(_Record):
    FIELDS = {"agent_class": None, "env_map": {}}


class RolloutK8sConfig(_Record):
    FIELDS = {"job_template": None}


class RolloutConfig(_Record):
    """The controller-facing rollout config."""

    FIELDS = {"timeout_seconds": 3600, "local": None, "k8s": None}
    PARTS = {"local": RolloutLocalConfig, "k8s": RolloutK8sConfig}


class RolloutMetadata(_Record):
    """Batch context; any key may be set (v1.0 allows extra fields)."""

    FIELDS = {"batch_idx": None, "sample_idx_in_batch": None}


def _as(model: type[_Record]) -> Any:
    return lambda value: model(value) if isinstance(value, Mapping) and not isinstance(value, model) else value


@attrs.define
class RolloutCreate(_ModelMethods):
    """What ``on_enqueue`` receives and returns."""

    input: Any
    is_train: bool = True
    config: RolloutConfig | None = attrs.field(default=None, converter=_as(RolloutConfig))
    metadata: RolloutMetadata | dict[str, Any] | None = attrs.field(default=None, converter=_as(RolloutMetadata))
    rollout_id: str | None = None


@attrs.define
class RolloutLifecycleStatus(_ModelMethods):
    """A rollout's status. ``version`` is v1.0's count of status updates in its store; agl reads no
    store record, so it keeps v1.0's starting value, 1."""

    state: RolloutState = attrs.field(default=RolloutState.QUEUING, converter=RolloutState)
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None
    version: int = 1
    created_at: float | None = None
    updated_at: float | None = None


@attrs.define
class RolloutStatusPatch(_ModelMethods):
    state: RolloutState | None = None
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None


@attrs.define
class RolloutPatch(_ModelMethods):
    status: RolloutStatusPatch | None = None


@attrs.define
class Rollout(_ModelMethods):
    """What ``on_succeeded`` / ``on_failed`` receive."""

    rollout_id: str
    input: Any
    is_train: bool = True
    config: RolloutConfig = attrs.field(factory=RolloutConfig, converter=_as(RolloutConfig))
    metadata: RolloutMetadata = attrs.field(factory=RolloutMetadata, converter=_as(RolloutMetadata))
    status: RolloutLifecycleStatus = attrs.field(factory=RolloutLifecycleStatus)


@attrs.define
class Event(_ModelMethods):
    """One event of a rollout's trace, as ``on_succeeded`` receives them."""

    event_type: str
    rollout_id: str
    attempt_id: str
    timestamp: float
    data: dict[str, Any]


@attrs.define
class EventCreate(_ModelMethods):
    event_type: str
    data: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class ModelRequestData(_ModelMethods):
    """The ``data`` of a ``model_request`` event."""

    model: str
    request: dict[str, Any]
    response: dict[str, Any]
    model_version: int | None = None
    adjusted_params: dict[str, Any] | None = None
    latency_ms: float | None = None
    http_status: int | None = None
    status: str = "ok"
    retry_count: int = 0
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None


@attrs.define
class RewardData(_ModelMethods):
    """The ``data`` of a ``reward`` event."""

    value: float
    message: str | None = None
    source: str | None = None
    reason: str | None = None


@attrs.define
class Model(_ModelMethods):
    """A registered model endpoint."""

    model: str
    endpoint: str
    version: int = 0
