"""The fast conversions of JSON-decoded ids and log-probs give what the item-by-item checks give."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_core.fields import DataValidationError, json_token_ids, log_probs, token_ids

json_items = (
    st.none()
    | st.booleans()
    | st.integers(-3, 40_000)
    | st.sampled_from([2**63 - 1, 2**63, -(2**63), 10**400, -(10**400)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=2)
    | st.lists(st.integers(), max_size=2)
)


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


@given(
    values=st.lists(st.floats(-50, 0) | st.integers(-5, 0) | st.just(-(10**40)) | st.booleans(), max_size=20)
    | st.lists(json_items, max_size=8)
)
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


def test_from_checked_needs_every_field():
    from agl_core.data import Triplet
    from agl_core.fields import from_checked

    with pytest.raises(TypeError, match="from_checked needs exactly the fields"):
        from_checked(Triplet, prompt_ids=np.zeros(1, dtype=np.int64))


@pytest.mark.parametrize("level", ["transition", "trajectory"])
def test_objects_built_without_a_second_check_are_what_the_constructors_build(gateway_traces, level):
    """The events parser's Triplets and the built-in aggregators' rows skip re-validation; rebuilding
    each through its validating constructor must give an equal object with the same dtypes."""
    import attrs

    from agl_core.builtins.aggregators import trajectory, transition
    from agl_core.data import RolloutRequest, TrainingRow, Triplet
    from agl_core.rollouts.events import completed_rollout_from_record
    from agl_core.stages.aggregation import AggregationSettings

    rollouts = []
    for name, scenario in sorted(gateway_traces.items()):
        record = scenario["rollout"]["rollout"]
        request = RolloutRequest(rollout_id=record["rollout_id"], group_id=name, input=record["input"])
        rollouts.append(completed_rollout_from_record(request, record, scenario["events"], reward_fillna_value=0.0)[0])
    triplets = [t for r in rollouts for t in r.triplets]
    rows = {"transition": transition, "trajectory": trajectory}[level](
        rollouts, AggregationSettings(max_prompt_length=64, max_response_length=64)
    ).rows
    assert triplets and rows
    for kind, objects in ((Triplet, triplets), (TrainingRow, rows)):
        for built in objects:
            fields = attrs.asdict(built, recurse=False)
            rebuilt = kind(**fields)
            assert rebuilt == built
            for name, value in fields.items():
                if isinstance(value, np.ndarray):
                    again = getattr(rebuilt, name)
                    assert value.dtype == again.dtype and not value.flags.writeable, (kind.__name__, name)
