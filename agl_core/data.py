"""The plain data that crosses every stage: Triplets, rollout requests and records, training rows.

Every class is a frozen attrs class validated on construction. Token ids and log-probs are stored
as read-only numpy arrays (int64 / float32): they are cheap to compare and slice, and cannot be
mutated by accident, so a stage can never corrupt what another stage reads. Mappings are stored
as :class:`FrozenDict`.

A violation raises :class:`DataValidationError`, which names the offending field and, where it is
known, the rollout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from agl_core.fields import (
    DataValidationError,
    FrozenDict,
    array_field,
    freeze,
    freeze_mapping,
    hardened,
    image_urls,
    log_probs,
    non_empty_str,
    non_negative_int,
    optional_reward,
    readonly,
    reward_value,
    thaw,
    timestamp,
    token_ids,
)

__all__ = [
    "DataValidationError",
    "FrozenDict",
    "Triplet",
    "RolloutRequest",
    "CompletedRollout",
    "TrainingRow",
    "ROLLOUT_STATES",
    "StepSamples",
    "TERMINAL_STATES",
]

ROLLOUT_STATES = ("queuing", "running", "succeeded", "failed")
TERMINAL_STATES = frozenset({"succeeded", "failed"})

StepSamples = Mapping[str, Sequence[Mapping[str, Any]]]
"""The sample tables a training step reports besides its metrics: table name (``trajectories``,
``mismatches``) → rows, each a JSON-like dict. Metric sinks write them as files or tables."""


@hardened
@attrs.frozen(kw_only=True)
class Triplet:
    """One successful model call: the prompt the model saw, what it generated, and how likely it was.

    ``response_log_probs`` is ``None`` when the server did not return log-probs (or returned the wrong
    number of them, which the events parser counts). ``reward`` is a per-call reward when the agent reported one
    for this call; the rollout's final reward lives on :class:`CompletedRollout`. ``image_urls`` are
    the images of the call's request messages, in order of appearance (their placeholder blocks are in
    ``prompt_ids``): ``data:image/...;base64,...`` URLs, ``file://`` URLs or absolute paths (the
    trainer fetches nothing from the network, so an ``http(s)`` URL is refused).
    """

    prompt_ids: np.ndarray = array_field(converter=lambda v: token_ids("prompt_ids", v))
    response_ids: np.ndarray = array_field(converter=lambda v: token_ids("response_ids", v))
    response_log_probs: np.ndarray | None = array_field(default=None)
    reward: float | None = attrs.field(default=None, converter=optional_reward("reward"))
    metadata: FrozenDict = attrs.field(factory=FrozenDict, converter=freeze_mapping)
    image_urls: tuple[str, ...] = attrs.field(default=(), converter=lambda v: image_urls("image_urls", v))

    def __attrs_post_init__(self) -> None:
        if self.response_log_probs is not None:
            checked = log_probs("response_log_probs", self.response_log_probs, len(self.response_ids))
            object.__setattr__(self, "response_log_probs", checked)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "prompt_ids": self.prompt_ids.tolist(),
            "response_ids": self.response_ids.tolist(),
            "response_log_probs": None if self.response_log_probs is None else self.response_log_probs.tolist(),
            "reward": self.reward,
            "metadata": thaw(self.metadata),
        }
        if self.image_urls:  # a text call's dict (and recording) is what it was before images
            out["image_urls"] = list(self.image_urls)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Triplet:
        _refuse_unknown("Triplet", data, attrs.fields_dict(cls))
        return cls(**data)


@hardened
@attrs.frozen(kw_only=True)
class RolloutRequest:
    """A rollout the trainer asks for: one agent run on one dataset row.

    ``rollout_id`` is chosen by the client before the create call so creation is idempotent.
    ``group_id`` is the dataset row's ``data_id``: the n rollouts of one row share it, and GRPO-style
    estimators compare within it. ``config`` is the controller-facing rollout config
    (``timeout_seconds``, ``local``, ``k8s``); ``metadata`` is free-form batch context.
    """

    rollout_id: str = attrs.field(validator=non_empty_str("rollout_id"))
    group_id: str = attrs.field(validator=non_empty_str("group_id"))
    input: Any = attrs.field(converter=freeze)
    is_train: bool = True
    step: int = attrs.field(default=0, validator=non_negative_int("step"))
    sample_index: int = attrs.field(default=0, validator=non_negative_int("sample_index"))
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
        return None if value is None else timestamp(field, value)

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


@hardened
@attrs.frozen(kw_only=True)
class CompletedRollout:
    """A rollout that reached a terminal state, with its Triplets and final reward.

    ``final_reward`` is the value of the last reward event (``None`` when the agent reported none;
    the events parser fills it with ``reward_fillna_value`` and counts it). ``queued_at``,
    ``started_at`` and ``ended_at`` are wall-clock seconds, used for the ``timing/rollout_*`` metrics.
    ``attempt_id`` is the gateway's last attempt; ``config`` the controller-facing rollout config.
    """

    rollout_id: str = attrs.field(validator=non_empty_str("rollout_id"))
    group_id: str = attrs.field(validator=non_empty_str("group_id"))
    state: str = attrs.field(validator=_state)
    triplets: tuple[Triplet, ...] = attrs.field(factory=tuple, converter=_triplets)
    final_reward: float | None = attrs.field(default=None, converter=optional_reward("final_reward"))
    step: int = attrs.field(default=0, validator=non_negative_int("step"))
    sample_index: int = attrs.field(default=0, validator=non_negative_int("sample_index"))
    is_train: bool = True
    input: Any = attrs.field(default=None, converter=freeze)
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
    """A read-only int8 array of 0 and 1 (a read-only int8 array is checked and kept as it is)."""
    array = np.asarray(value)
    if array.ndim != 1:
        raise DataValidationError("response_mask", f"expected a 1-D sequence, got shape {array.shape}")
    if array.size and not ((array == 0) | (array == 1)).all():
        raise DataValidationError("response_mask", "must hold only 0 and 1")
    if array is value and array.dtype == np.int8 and not array.flags.writeable:
        return array
    return readonly(array.astype(np.int8, copy=True))


def _turns(value: Any) -> np.ndarray:
    """A read-only int32 array of call indices (a read-only int32 array is checked and kept as it is)."""
    if isinstance(value, np.ndarray) and value.dtype == np.int32 and value.ndim == 1 and not value.flags.writeable:
        if value.size and value.min() < 0:
            token_ids("response_turns", value)  # names the first negative entry
        return value
    array = token_ids("response_turns", value)
    return readonly(array.astype(np.int32))


@hardened
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
    ``image_urls`` are the images whose placeholder blocks are in the row's prompt + response, in
    order (a row never keeps part of a block); validated as ``Triplet.image_urls``.
    """

    prompt_ids: np.ndarray = array_field(converter=lambda v: token_ids("prompt_ids", v))
    response_ids: np.ndarray = array_field(converter=lambda v: token_ids("response_ids", v))
    response_mask: np.ndarray = array_field(converter=_mask)
    log_probs: np.ndarray | None = array_field(default=None)
    reward: float = attrs.field(converter=lambda v: reward_value("reward", v))
    rollout_id: str = attrs.field(validator=non_empty_str("rollout_id"))
    group_id: str = attrs.field(validator=non_empty_str("group_id"))
    turn_index: int = attrs.field(default=0, validator=non_negative_int("turn_index"))
    response_turns: np.ndarray | None = array_field(default=None)
    turn_rewards: tuple[float | None, ...] = attrs.field(default=(), converter=tuple)
    dropped: bool = False
    image_urls: tuple[str, ...] = attrs.field(default=(), converter=lambda v: image_urls("image_urls", v))

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
        if self.image_urls:
            out["image_urls"] = list(self.image_urls)
        else:  # a text row's dict is what it was before images
            del out["image_urls"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainingRow:
        _refuse_unknown("TrainingRow", data, attrs.fields_dict(cls))
        return cls(**data)


def _refuse_unknown(kind: str, data: Mapping[str, Any], fields: Mapping[str, Any]) -> None:
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise DataValidationError(unknown[0], f"unknown field for {kind} (known: {sorted(fields)})")
