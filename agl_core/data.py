"""The plain data that crosses every stage: Triplets, rollout requests and records, training rows.

Every class is a frozen attrs class validated on construction. Token ids and log-probs are stored
as read-only numpy arrays (int64 / float32): they are cheap to compare and slice, and cannot be
mutated by accident, so a stage can never corrupt what another stage reads. Mappings are stored
as :class:`FrozenDict`.

A violation raises :class:`DataValidationError`, which names the offending field and, where it is
known, the rollout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

__all__ = [
    "DataValidationError",
    "FrozenDict",
    "Triplet",
    "RolloutRequest",
    "CompletedRollout",
    "TrainingRow",
    "ROLLOUT_STATES",
    "TERMINAL_STATES",
]

ROLLOUT_STATES = ("queuing", "running", "succeeded", "failed")
TERMINAL_STATES = frozenset({"succeeded", "failed"})


class DataValidationError(ValueError):
    """A field of a data-model object holds a value that would corrupt training.

    ``field`` is a dotted path (``triplets[2].response_log_probs``); ``rollout_id`` is set when the
    error is known to belong to one rollout.
    """

    def __init__(self, field: str, message: str, rollout_id: str | None = None):
        self.field = field
        self.message = message
        self.rollout_id = rollout_id
        where = f"rollout {rollout_id!r}: " if rollout_id is not None else ""
        super().__init__(f"{where}{field}: {message}")

    def within(self, prefix: str | None = None, rollout_id: str | None = None) -> DataValidationError:
        """The same error seen from an enclosing object (a longer field path, a known rollout)."""
        field = f"{prefix}.{self.field}" if prefix else self.field
        return DataValidationError(field, self.message, rollout_id if rollout_id is not None else self.rollout_id)


class FrozenDict(dict):
    """A dict that refuses mutation; picklable (it travels to Ray workers) and JSON-serialisable."""

    def _readonly(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("FrozenDict is read-only; build a new mapping instead")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]
    __ior__ = _readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items(), key=lambda kv: str(kv[0]))))

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (dict(self),))


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return FrozenDict({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Plain JSON-able Python values (dicts, lists) from frozen ones."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def freeze_mapping(value: Mapping[str, Any] | None) -> FrozenDict:
    if value is None:
        return FrozenDict()
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a mapping, got {type(value).__name__}")
    return _freeze(value)


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def token_ids(field: str, value: Any) -> np.ndarray:
    """Validate and freeze a sequence of token ids as a read-only int64 array."""
    if isinstance(value, np.ndarray) and value.dtype == np.int64 and not value.flags.writeable:
        array = value
    else:
        if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
            raise DataValidationError(field, f"expected a sequence of token ids, got {type(value).__name__}")
        if isinstance(value, np.ndarray):
            if value.ndim != 1:
                raise DataValidationError(field, f"expected a 1-D sequence, got shape {value.shape}")
            if value.size and not np.issubdtype(value.dtype, np.integer):
                raise DataValidationError(field, f"token ids must be integers, got dtype {value.dtype}")
            array = value.astype(np.int64, copy=True)
        else:
            for i, v in enumerate(value):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise DataValidationError(f"{field}[{i}]", f"token id must be an int, got {v!r}")
            array = np.array(value, dtype=np.int64) if len(value) else np.zeros(0, dtype=np.int64)
        array = _readonly(array)
    if array.size and array.min() < 0:
        i = int(np.argmax(array < 0))
        raise DataValidationError(f"{field}[{i}]", f"token id must be non-negative, got {int(array[i])}")
    return array


def log_probs(field: str, value: Any, length: int) -> np.ndarray:
    """Validate and freeze log-probs: finite, <= 0 and exactly ``length`` of them."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise DataValidationError(field, f"expected a sequence of floats, got {type(value).__name__}")
    if not isinstance(value, np.ndarray):
        for i, v in enumerate(value):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
                raise DataValidationError(f"{field}[{i}]", f"log-prob must be a number, got {v!r}")
    array = np.asarray(value, dtype=np.float32)
    if array.ndim != 1:
        raise DataValidationError(field, f"expected a 1-D sequence, got shape {array.shape}")
    if array.shape[0] != length:
        raise DataValidationError(field, f"has {array.shape[0]} log-probs for {length} tokens")
    if array.size:
        bad = ~np.isfinite(array) | (array > 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise DataValidationError(f"{field}[{i}]", f"log-prob must be finite and <= 0, got {float(array[i])}")
    if array is value:
        array = array.copy()
    return _readonly(array)


def reward_value(field: str, value: Any) -> float:
    """A finite float reward; booleans and non-numbers are refused rather than coerced."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise DataValidationError(field, f"reward must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise DataValidationError(field, f"reward must be finite, got {value}")
    return value


def _optional_reward(field: str):
    def convert(value: Any) -> float | None:
        return None if value is None else reward_value(field, value)

    return convert


def _non_empty_str(field: str):
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        if not isinstance(value, str) or not value:
            raise DataValidationError(field, f"must be a non-empty string, got {value!r}")

    return check


def _non_negative_int(field: str):
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise DataValidationError(field, f"must be a non-negative int, got {value!r}")

    return check


def _array_eq(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _array_field(**kwargs: Any) -> Any:
    return attrs.field(eq=attrs.cmp_using(eq=_array_eq), **kwargs)


def _hardened(cls: type) -> type:
    """Make every validation error raised while building ``cls`` name the rollout it belongs to, and
    keep its arrays read-only after unpickling (objects travel to Ray workers by pickle)."""
    init = cls.__init__
    setstate = cls.__setstate__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except DataValidationError as err:
            rollout_id = kwargs.get("rollout_id")
            raise err.within(rollout_id=rollout_id if isinstance(rollout_id, str) else None) from None

    def __setstate__(self: Any, state: Any) -> None:
        setstate(self, state)
        for value in attrs.astuple(self, recurse=False):
            if isinstance(value, np.ndarray):
                value.flags.writeable = False

    cls.__init__ = __init__  # type: ignore[method-assign]
    cls.__setstate__ = __setstate__  # type: ignore[attr-defined]
    return cls


@_hardened
@attrs.frozen(kw_only=True)
class Triplet:
    """One successful model call: the prompt the model saw, what it generated, and how likely it was.

    ``response_log_probs`` is ``None`` when the server did not return log-probs (or returned the wrong
    number of them: see :meth:`from_parts`). ``reward`` is a per-call reward when the agent reported one
    for this call; the rollout's final reward lives on :class:`CompletedRollout`.
    """

    prompt_ids: np.ndarray = _array_field(converter=lambda v: token_ids("prompt_ids", v))
    response_ids: np.ndarray = _array_field(converter=lambda v: token_ids("response_ids", v))
    response_log_probs: np.ndarray | None = _array_field(default=None)
    reward: float | None = attrs.field(default=None, converter=_optional_reward("reward"))
    metadata: FrozenDict = attrs.field(factory=FrozenDict, converter=freeze_mapping)

    def __attrs_post_init__(self) -> None:
        if self.response_log_probs is not None:
            checked = log_probs("response_log_probs", self.response_log_probs, len(self.response_ids))
            object.__setattr__(self, "response_log_probs", checked)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_ids": self.prompt_ids.tolist(),
            "response_ids": self.response_ids.tolist(),
            "response_log_probs": None if self.response_log_probs is None else self.response_log_probs.tolist(),
            "reward": self.reward,
            "metadata": thaw(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Triplet:
        _refuse_unknown("Triplet", data, attrs.fields_dict(cls))
        return cls(**data)


@_hardened
@attrs.frozen(kw_only=True)
class RolloutRequest:
    """A rollout the trainer asks for: one agent run on one dataset row.

    ``rollout_id`` is chosen by the client before the create call so creation is idempotent.
    ``group_id`` is the dataset row's ``data_id``: the n rollouts of one row share it, and GRPO-style
    estimators compare within it. ``config`` is the controller-facing rollout config
    (``timeout_seconds``, ``local``, ``k8s``); ``metadata`` is free-form batch context.
    """

    rollout_id: str = attrs.field(validator=_non_empty_str("rollout_id"))
    group_id: str = attrs.field(validator=_non_empty_str("group_id"))
    input: Any = attrs.field(converter=_freeze)
    is_train: bool = True
    step: int = attrs.field(default=0, validator=_non_negative_int("step"))
    sample_index: int = attrs.field(default=0, validator=_non_negative_int("sample_index"))
    config: FrozenDict = attrs.field(factory=FrozenDict, converter=freeze_mapping)
    metadata: FrozenDict = attrs.field(factory=FrozenDict, converter=freeze_mapping)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "group_id": self.group_id,
            "input": thaw(self.input),
            "is_train": self.is_train,
            "step": self.step,
            "sample_index": self.sample_index,
            "config": thaw(self.config),
            "metadata": thaw(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RolloutRequest:
        _refuse_unknown("RolloutRequest", data, attrs.fields_dict(cls))
        return cls(**data)


def _state(_instance: Any, _attribute: Any, value: Any) -> None:
    if value not in ROLLOUT_STATES:
        raise DataValidationError("state", f"must be one of {ROLLOUT_STATES}, got {value!r}")


def _optional_time(field: str):
    def convert(value: Any) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataValidationError(field, f"must be a finite timestamp in seconds, got {value!r}")
        return float(value)

    return convert


def _triplets(value: Iterable[Any]) -> tuple[Triplet, ...]:
    out = []
    for i, t in enumerate(value):
        if isinstance(t, Mapping):
            try:
                t = Triplet.from_dict(t)
            except DataValidationError as err:
                raise err.within(f"triplets[{i}]") from None
        elif not isinstance(t, Triplet):
            raise DataValidationError(f"triplets[{i}]", f"expected a Triplet, got {type(t).__name__}")
        out.append(t)
    return tuple(out)


@_hardened
@attrs.frozen(kw_only=True)
class CompletedRollout:
    """A rollout that reached a terminal state, with its Triplets and final reward.

    ``final_reward`` is the value of the last reward event (``None`` when the agent reported none;
    the events parser fills it with ``reward_fillna_value`` and counts it). ``queued_at``,
    ``started_at`` and ``ended_at`` are wall-clock seconds, used for the ``timing/rollout_*`` metrics.
    ``attempt_id`` is the gateway's last attempt; ``config`` the controller-facing rollout config.
    """

    rollout_id: str = attrs.field(validator=_non_empty_str("rollout_id"))
    group_id: str = attrs.field(validator=_non_empty_str("group_id"))
    state: str = attrs.field(validator=_state)
    triplets: tuple[Triplet, ...] = attrs.field(factory=tuple, converter=_triplets)
    final_reward: float | None = attrs.field(default=None, converter=_optional_reward("final_reward"))
    step: int = attrs.field(default=0, validator=_non_negative_int("step"))
    sample_index: int = attrs.field(default=0, validator=_non_negative_int("sample_index"))
    is_train: bool = True
    input: Any = attrs.field(default=None, converter=_freeze)
    queued_at: float | None = attrs.field(default=None, converter=_optional_time("queued_at"))
    started_at: float | None = attrs.field(default=None, converter=_optional_time("started_at"))
    ended_at: float | None = attrs.field(default=None, converter=_optional_time("ended_at"))
    error: str | None = None
    attempt_id: str | None = None
    config: FrozenDict = attrs.field(factory=FrozenDict, converter=freeze_mapping)
    metadata: FrozenDict = attrs.field(factory=FrozenDict, converter=freeze_mapping)

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        out["config"] = thaw(self.config)
        out["triplets"] = [t.to_dict() for t in self.triplets]
        out["input"] = thaw(self.input)
        out["metadata"] = thaw(self.metadata)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompletedRollout:
        _refuse_unknown("CompletedRollout", data, attrs.fields_dict(cls))
        return cls(**data)


def _mask(value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != 1:
        raise DataValidationError("response_mask", f"expected a 1-D sequence, got shape {array.shape}")
    if array.size and not np.isin(array, (0, 1)).all():
        raise DataValidationError("response_mask", "must hold only 0 and 1")
    return _readonly(array.astype(np.int8, copy=True))


def _turns(value: Any) -> np.ndarray:
    array = token_ids("response_turns", value)
    return _readonly(array.astype(np.int32))


@_hardened
@attrs.frozen(kw_only=True)
class TrainingRow:
    """One training sample: a prompt, a response whose trained tokens are marked, and credit info.

    ``response_mask`` is 1 on model-generated tokens to train and 0 on observation tokens (tool
    output, user turns, template tokens) appended between merged calls. ``log_probs`` are the
    rollout-time log-probs of the response tokens (0 on observation tokens), or ``None`` when any
    merged call lacked them. ``turn_index`` is the index (in the rollout's Triplets) of the first call
    merged into the row; ``response_turns`` gives, for each response token, the index of the call it
    belongs to (observation tokens belong to the call whose prompt introduced them);
    ``turn_rewards`` holds the per-call rewards of the merged calls, in order. ``dropped`` marks a
    row whose prompt exceeded its limit: it is counted, then removed before training.
    """

    prompt_ids: np.ndarray = _array_field(converter=lambda v: token_ids("prompt_ids", v))
    response_ids: np.ndarray = _array_field(converter=lambda v: token_ids("response_ids", v))
    response_mask: np.ndarray = _array_field(converter=_mask)
    log_probs: np.ndarray | None = _array_field(default=None)
    reward: float = attrs.field(converter=lambda v: reward_value("reward", v))
    rollout_id: str = attrs.field(validator=_non_empty_str("rollout_id"))
    group_id: str = attrs.field(validator=_non_empty_str("group_id"))
    turn_index: int = attrs.field(default=0, validator=_non_negative_int("turn_index"))
    response_turns: np.ndarray | None = _array_field(default=None)
    turn_rewards: tuple[float | None, ...] = attrs.field(default=(), converter=tuple)
    dropped: bool = False

    def __attrs_post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.response_mask) != n:
            raise DataValidationError("response_mask", f"has {len(self.response_mask)} entries for {n} response tokens")
        if self.log_probs is not None:
            object.__setattr__(self, "log_probs", log_probs("log_probs", self.log_probs, n))
        if self.response_turns is not None:
            turns = _turns(self.response_turns)
            if len(turns) != n:
                raise DataValidationError("response_turns", f"has {len(turns)} entries for {n} response tokens")
            object.__setattr__(self, "response_turns", turns)
        for i, r in enumerate(self.turn_rewards):
            if r is not None:
                reward_value(f"turn_rewards[{i}]", r)

    @property
    def n_trained_tokens(self) -> int:
        return int(self.response_mask.sum())

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        for key in ("prompt_ids", "response_ids", "response_mask", "log_probs", "response_turns"):
            out[key] = thaw(out[key])
        out["turn_rewards"] = list(self.turn_rewards)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainingRow:
        _refuse_unknown("TrainingRow", data, attrs.fields_dict(cls))
        return cls(**data)


def _refuse_unknown(kind: str, data: Mapping[str, Any], fields: Mapping[str, Any]) -> None:
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise DataValidationError(unknown[0], f"unknown field for {kind} (known: {sorted(fields)})")
