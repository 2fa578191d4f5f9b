"""The fast conversions of JSON-decoded ids and log-probs give what the item-by-item checks give."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_core.fields import DataValidationError, json_token_ids, log_probs, token_ids

json_items = st.none() | st.booleans() | st.integers(-3, 40_000) | st.floats(allow_nan=True) | st.text(max_size=2) | st.lists(st.integers(), max_size=2)


def _outcome(convert, *args):
    try:
        array = convert(*args)
    except DataValidationError as err:
        return ("error", str(err))
    assert not array.flags.writeable
    return ("ok", array.dtype, array.tolist())


@given(ids=st.lists(st.integers(0, 40_000), max_size=50) | st.lists(json_items, max_size=12))
@settings(max_examples=300, deadline=None)
def test_json_token_ids_agree_with_token_ids(ids):
    assert _outcome(json_token_ids, "ids", ids) == _outcome(token_ids, "ids", ids)


@pytest.mark.parametrize("bad", [[5, True, 7], [0, False], [1, 2.0], [3, "4"], [2, -1]])
def test_booleans_hidden_among_ids_are_still_refused(bad):
    with pytest.raises(DataValidationError) as fast:
        json_token_ids("ids", bad)
    with pytest.raises(DataValidationError) as slow:
        token_ids("ids", bad)
    assert str(fast.value) == str(slow.value)


@given(values=st.lists(st.floats(-50, 0) | st.integers(-5, 0), max_size=20) | st.lists(json_items, max_size=8))
@settings(max_examples=300, deadline=None)
def test_log_probs_of_plain_numbers_agree_with_the_item_by_item_check(values):
    fast = _outcome(log_probs, "lp", values, len(values))
    # A tuple takes the item-by-item path.
    slow = _outcome(log_probs, "lp", tuple(values), len(values))
    assert fast == slow


def test_a_read_only_float32_array_is_kept_and_a_writable_one_copied():
    kept = np.array([-1.0, -0.5], dtype=np.float32)
    kept.flags.writeable = False
    assert log_probs("lp", kept, 2) is kept
    writable = np.array([-1.0, -0.5], dtype=np.float32)
    out = log_probs("lp", writable, 2)
    assert out is not writable and not out.flags.writeable
