"""Field converters and validators of the data model (:mod:`agl_core.data`).

Each converter takes the field's dotted path, so that a bad value raises a
:class:`DataValidationError` naming exactly where it is. Token ids and log-probs become read-only
numpy arrays (int64 / float32); mappings become :class:`FrozenDict`.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from agl_core.errors import AglError, UsageTypeError

__all__ = [
    "DataValidationError",
    "FrozenDict",
    "array_eq",
    "array_field",
    "freeze",
    "freeze_mapping",
    "from_checked",
    "hardened",
    "image_urls",
    "is_int",
    "is_number",
    "json_token_ids",
    "log_probs",
    "non_empty_str",
    "non_negative_int",
    "optional_reward",
    "readonly",
    "reward_value",
    "thaw",
    "timestamp",
    "token_ids",
]


def is_int(value: object, minimum: int | None = None) -> bool:
    """Whether ``value`` is an integer (numpy's too), not a bool, and at least ``minimum`` when given:
    the one test of every count, size and id that agl checks (``minimum=1``: a positive int)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return False
    return minimum is None or value >= minimum


def is_number(value: object) -> bool:
    """Whether ``value`` is an int or a float (numpy's too), not a bool (NaN and infinities included)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


class DataValidationError(AglError, ValueError):
    """A field of a data-model object holds a value that would corrupt training.

    ``field`` is a dotted path (``triplets[2].response_log_probs``); ``rollout_id`` is set when the
    error is known to belong to one rollout.
    """

    __module__ = "agl_core"

    def __init__(self, field: str, message: str, rollout_id: str | None = None):
        self.field = field
        self.message = message
        self.rollout_id = rollout_id
        where = f"rollout {rollout_id!r}: " if rollout_id is not None else ""
        super().__init__(f"{where}{field}: {message}")

    def within(self, prefix: str | None = None, rollout_id: str | None = None) -> DataValidationError:
        """The same error seen from an enclosing object (a longer field path, a known rollout)."""
        field = f"{prefix}.{self.field}" if prefix else self.field
        return type(self)(field, self.message, rollout_id if rollout_id is not None else self.rollout_id)


class FrozenDict(dict):
    """A dict that refuses mutation; picklable (it travels to Ray workers) and JSON-serialisable."""

    __module__ = "agl_core"

    def readonly(self, *args: Any, **kwargs: Any) -> None:
        raise UsageTypeError("FrozenDict is read-only; build a new mapping instead")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = readonly  # type: ignore[assignment]
    __ior__ = readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items(), key=lambda kv: str(kv[0]))))

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (dict(self),))


_SCALARS = frozenset({str, int, float, bool, type(None)})


def freeze(value: Any) -> Any:
    if type(value) in _SCALARS:  # the common case, without the ABC checks below
        return value
    if isinstance(value, Mapping):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
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
        raise UsageTypeError(f"expected a mapping, got {type(value).__name__}")
    return freeze(value)


def readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _brief(value: Any) -> str:
    """``repr(value)`` cut to a readable length: a hostile value (a 4,000-digit int, a huge list) must
    not turn an error message into a dump."""
    if type(value) is int and not -(10**40) < value < 10**40:
        return f"an int of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fits_float(value: Any) -> bool:
    """Whether ``float(value)`` works: JSON integers are unbounded, floats are not."""
    try:
        float(value)
    except (OverflowError, TypeError, ValueError):
        return False
    return True


def _all_ints(values: list[Any]) -> bool:
    """Whether every item is exactly an ``int`` (not a bool): one pass in C, no per-item Python call."""
    return list(map(type, values)).count(int) == len(values)


def _all_numbers(values: list[Any]) -> bool:
    """Whether every item is exactly an ``int`` or a ``float`` (not a bool)."""
    types = list(map(type, values))
    return types.count(float) + types.count(int) == len(values)


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _ids_item_by_item(field: str, value: Sequence[Any]) -> np.ndarray:
    for i, v in enumerate(value):
        if not is_int(v):
            raise DataValidationError(f"{field}[{i}]", f"token id must be an int, got {_brief(v)}")
        if not _INT64_MIN <= v <= _INT64_MAX:
            raise DataValidationError(
                f"{field}[{i}]", f"token id must be non-negative and below 2**63, got {_brief(v)}"
            )
    return np.array(value, dtype=np.int64) if len(value) else np.zeros(0, dtype=np.int64)


def token_ids(field: str, value: Any) -> np.ndarray:
    """Validate and freeze a sequence of token ids as a read-only int64 array.

    A list of plain ints (what JSON decoding gives) is converted in one step; anything else is
    checked item by item, so a bad item is reported with its index.
    """
    if isinstance(value, np.ndarray) and value.dtype == np.int64 and not value.flags.writeable:
        array = value
    elif type(value) is list and _all_ints(value):
        try:
            array = np.array(value, dtype=np.int64) if value else np.zeros(0, dtype=np.int64)
        except OverflowError:  # JSON integers are unbounded
            array = _ids_item_by_item(field, value)
        array = readonly(array)
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
            array = _ids_item_by_item(field, value)
        array = readonly(array)
    if array.size and array.min() < 0:
        i = int(np.argmax(array < 0))
        raise DataValidationError(f"{field}[{i}]", f"token id must be non-negative, got {int(array[i])}")
    return array


def json_token_ids(field: str, value: Any) -> np.ndarray:
    """:func:`token_ids` for a value decoded from JSON (ints, floats, strings, bools, None, lists,
    dicts): the same array, or the same error, several times faster on long lists.

    ``struct.pack`` with ``q`` converts a list in one C pass (about three times faster than
    ``array('q')``) and refuses every JSON type but int and bool, and every int outside int64; a bool
    can only hide behind a 0 or a 1, so those few items are checked one by one. Anything else, or
    any doubt, goes through :func:`token_ids`, which names the offending item.
    """
    if type(value) is not list or not value:
        return token_ids(field, value)
    try:
        ids = np.frombuffer(struct.pack(f"{len(value)}q", *value), dtype=np.int64)  # bytes: read-only
    except (TypeError, struct.error):
        return token_ids(field, value)
    if ids.min() > 1:  # no 0 or 1 a bool could hide behind, and nothing negative
        return ids
    if any(value[i] is True or value[i] is False for i in np.flatnonzero(ids <= 1).tolist()):
        return token_ids(field, value)
    return token_ids(field, ids)


def _json_log_probs(value: list[Any], length: int) -> np.ndarray | None:
    """Log-probs decoded from JSON in one C pass, or ``None`` when anything needs a closer look.

    ``struct.pack`` with ``f`` rounds to float32 as numpy does and refuses every JSON type but numbers
    and bools, and any number beyond float32 range; the result is kept only when it has ``length``
    finite values below zero, or zeros that are not ``False``. Any doubt goes to the checks of
    :func:`log_probs`, which name the offending item.
    """
    if len(value) != length:
        return None
    try:
        array = np.frombuffer(struct.pack(f"{length}f", *value), dtype=np.float32)  # bytes: read-only
    except (TypeError, OverflowError, struct.error):
        return None
    if not length:
        return array
    top = array.max()
    if not (math.isfinite(array.min()) and top <= 0):
        return None
    if top == 0 and any(value[i] is False for i in np.flatnonzero(array == 0).tolist()):
        return None
    return array


def log_probs(field: str, value: Any, length: int) -> np.ndarray:
    """Validate and freeze log-probs: finite, <= 0 and exactly ``length`` of them.

    A read-only float32 array is checked and kept as it is (no copy).
    """
    if type(value) is list and (fast := _json_log_probs(value, length)) is not None:
        return fast
    if type(value) is list and _all_numbers(value):
        pass  # plain numbers, as JSON decoding gives them
    elif isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise DataValidationError(field, f"expected a sequence of floats, got {type(value).__name__}")
    elif not isinstance(value, np.ndarray):
        for i, v in enumerate(value):
            if not is_number(v):
                raise DataValidationError(f"{field}[{i}]", f"log-prob must be a number, got {_brief(v)}")
    try:
        with np.errstate(over="ignore"):  # a float64 beyond float32 range becomes inf, refused below
            array = np.asarray(value, dtype=np.float32)
    except OverflowError:  # an integer beyond float range
        i = next(i for i, v in enumerate(value) if not _fits_float(v))
        raise DataValidationError(
            f"{field}[{i}]", f"log-prob must be finite and <= 0, got {_brief(value[i])}"
        ) from None
    if array.ndim != 1:
        raise DataValidationError(field, f"expected a 1-D sequence, got shape {array.shape}")
    if array.shape[0] != length:
        raise DataValidationError(field, f"has {array.shape[0]} log-probs for {length} tokens")
    # min() is NaN when any value is NaN, so two reductions decide; the index is found only on failure.
    if array.size and not (math.isfinite(array.min()) and array.max() <= 0):
        i = int(np.argmax(~np.isfinite(array) | (array > 0)))
        raise DataValidationError(f"{field}[{i}]", f"log-prob must be finite and <= 0, got {float(array[i])}")
    if not array.flags.writeable:
        return array
    return readonly(array.copy() if array is value else array)


def reward_value(field: str, value: Any) -> float:
    """A finite float reward; booleans and non-numbers are refused rather than coerced."""
    if not is_number(value):
        raise DataValidationError(field, f"reward must be a number, got {_brief(value)}")
    if not _fits_float(value) or not math.isfinite(value):
        raise DataValidationError(field, f"reward must be finite, got {_brief(value)}")
    return float(value)


def timestamp(field: str, value: Any) -> float:
    """Wall-clock seconds as a finite float; booleans, non-numbers and integers beyond float range
    are refused."""
    if type(value) is float and math.isfinite(value):  # the common case, decided at once
        return value
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not _fits_float(value)
        or not math.isfinite(value)
    ):
        raise DataValidationError(field, f"must be a finite timestamp in seconds, got {_brief(value)}")
    return float(value)


def _image_url_problem(url: Any) -> str | None:
    """Why ``url`` is no image the trainer can load, or ``None`` when it is one."""
    if not isinstance(url, str) or not url:
        return f"must be a non-empty string, got {_brief(url)}"
    lower = url[:16].lower()
    if lower.startswith(("http://", "https://")):
        return (
            f"{url[:40]!r} is fetched over the network, which the trainer never does (it trains on what "
            "the agent sent, offline); have the agent send the image inline, as a data:image/...;base64 URL"
        )
    if lower.startswith("data:"):
        head = url[:100].partition(",")[0].lower()
        if not head.startswith("data:image/") or not head.endswith(";base64"):
            return f"{url[:40]!r} is a data URL that is not a base64 image (data:image/<type>;base64,...)"
        return None
    if lower.startswith("file://") or url.startswith("/"):
        return None
    return f"{url[:40]!r} is not an image URL the trainer loads: data:image/...;base64,..., file:// or an absolute path"


def image_urls(field: str, value: Any) -> tuple[str, ...]:
    """A tuple of image URLs the trainer can load without a network: ``data:image/...;base64,...``,
    ``file://`` URLs and absolute paths; anything else (an ``http(s)`` URL above all) is refused,
    naming ``field[i]``."""
    if isinstance(value, tuple) and not value:
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise DataValidationError(field, f"must be a sequence of image URLs, got {_brief(value)}")
    for i, url in enumerate(value):
        problem = _image_url_problem(url)
        if problem is not None:
            raise DataValidationError(f"{field}[{i}]", problem)
    return tuple(value)


def optional_reward(field: str):
    def convert(value: Any) -> float | None:
        return None if value is None else reward_value(field, value)

    return convert


def non_empty_str(field: str):
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        if not isinstance(value, str) or not value:
            raise DataValidationError(field, f"must be a non-empty string, got {value!r}")

    return check


def non_negative_int(field: str):
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        if not is_int(value, minimum=0):
            raise DataValidationError(field, f"must be a non-negative int, got {value!r}")

    return check


def array_eq(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool(np.array_equal(a, b))


def array_field(**kwargs: Any) -> Any:
    return attrs.field(eq=attrs.cmp_using(eq=array_eq), **kwargs)


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(attrs.fields_dict(cls))


def from_checked(cls: type, **values: Any) -> Any:
    """An instance of the attrs class ``cls`` from values its converters already returned (read-only
    arrays of the right dtypes and lengths, checked rewards, frozen mappings), without converting
    and validating them a second time. Every field must be given.

    For agl's own hot paths, which build objects from parts that were checked on the way in (the
    events parser's Triplets, the built-in aggregators' rows); values from elsewhere go through the
    constructor.
    """
    if values.keys() != _field_names(cls):
        raise UsageTypeError(f"{cls.__name__}: from_checked needs exactly the fields {sorted(_field_names(cls))}")
    instance = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(instance, name, value)
    return instance


def hardened(cls: type) -> type:
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
