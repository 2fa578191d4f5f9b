"""The data model refuses every value that would corrupt training, and round-trips every valid one."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_core.data import (
    CompletedRollout,
    DataValidationError,
    FrozenDict,
    RolloutRequest,
    TrainingRow,
    Triplet,
)

token_lists = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)


@st.composite
def valid_triplets(draw):
    prompt = draw(token_lists)
    response = draw(token_lists)
    log_probs = draw(
        st.none() | st.lists(st.floats(-50.0, 0.0, allow_nan=False), min_size=len(response), max_size=len(response))
    )
    reward = draw(st.none() | st.floats(-10, 10, allow_nan=False))
    metadata = draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3))
    return Triplet(
        prompt_ids=prompt, response_ids=response, response_log_probs=log_probs, reward=reward, metadata=metadata
    )


@settings(max_examples=200)
@given(valid_triplets())
def test_valid_triplets_round_trip_through_json(triplet):
    data = json.loads(json.dumps(triplet.to_dict()))
    assert Triplet.from_dict(data) == triplet
    assert pickle.loads(pickle.dumps(triplet)) == triplet


@st.composite
def invalid_triplet_kwargs(draw):
    """A valid Triplet's fields with exactly one field broken; returns (kwargs, broken field)."""
    response = draw(st.lists(st.integers(0, 100), min_size=1, max_size=10))
    kwargs = {
        "prompt_ids": draw(st.lists(st.integers(0, 100), min_size=1, max_size=10)),
        "response_ids": response,
        "response_log_probs": [-0.5] * len(response),
        "reward": 1.0,
    }
    broken = draw(st.sampled_from(["prompt_ids", "response_ids", "response_log_probs", "reward"]))
    if broken in ("prompt_ids", "response_ids"):
        bad = draw(st.sampled_from(["negative", "float", "bool", "string", "nested"]))
        ids = list(kwargs[broken])
        position = draw(st.integers(0, len(ids) - 1))
        ids[position] = {
            "negative": -draw(st.integers(1, 10**6)),
            "float": 1.5,
            "bool": True,
            "string": "7",
            "nested": [1],
        }[bad]
        kwargs[broken] = ids
        if broken == "response_ids":
            kwargs["response_log_probs"] = [-0.5] * len(ids)
    elif broken == "response_log_probs":
        bad = draw(st.sampled_from(["positive", "nan", "inf", "length", "string"]))
        lps = [-0.5] * len(response)
        if bad == "length":
            lps = lps + [-0.1] * draw(st.integers(1, 3)) if draw(st.booleans()) else lps[:-1]
        else:
            lps[draw(st.integers(0, len(lps) - 1))] = {
                "positive": draw(st.floats(1e-3, 10)),
                "nan": math.nan,
                "inf": -math.inf,
                "string": "x",
            }[bad]
        kwargs["response_log_probs"] = lps
    else:
        kwargs["reward"] = draw(st.sampled_from([math.nan, math.inf, -math.inf, True, "1.0", [1.0]]))
    return kwargs, broken


@settings(max_examples=300)
@given(invalid_triplet_kwargs())
def test_invalid_triplets_are_rejected_naming_the_field(case):
    kwargs, broken = case
    with pytest.raises(DataValidationError) as info:
        Triplet(**kwargs)
    assert info.value.field.split("[")[0] == broken


def test_error_names_rollout_and_nested_field():
    with pytest.raises(DataValidationError, match=r"rollout 'r-7': triplets\[1\]\.response_ids\[0\]"):
        CompletedRollout.from_dict(
            {
                "rollout_id": "r-7",
                "group_id": "g",
                "state": "succeeded",
                "triplets": [{"prompt_ids": [1], "response_ids": [2]}, {"prompt_ids": [1], "response_ids": [-3]}],
            }
        )
    with pytest.raises(DataValidationError, match=r"rollout 'r-8': response_mask"):
        TrainingRow(prompt_ids=[1], response_ids=[2, 3], response_mask=[1], reward=0.0, rollout_id="r-8", group_id="g")
    with pytest.raises(DataValidationError, match=r"rollout 'r-9': state"):
        CompletedRollout(rollout_id="r-9", group_id="g", state="done")
    with pytest.raises(DataValidationError, match="unknown field for Triplet"):
        Triplet.from_dict({"prompt_ids": [1], "response_ids": [2], "logprobs": [0.0]})


def test_nothing_is_mutable_by_accident():
    triplet = Triplet(prompt_ids=[1, 2], response_ids=[3], response_log_probs=[-1.0], metadata={"a": [1, {"b": 2}]})
    with pytest.raises(ValueError):
        triplet.prompt_ids[0] = 9
    with pytest.raises(ValueError):
        triplet.response_log_probs[0] = -2.0
    with pytest.raises(TypeError):
        triplet.metadata["a"] = 1
    with pytest.raises(TypeError):
        triplet.metadata["a"][1]["b"] = 3
    with pytest.raises(AttributeError):
        triplet.reward = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError):
        pickle.loads(pickle.dumps(triplet)).prompt_ids[0] = 9
    source = np.array([1, 2, 3])
    copy = Triplet(prompt_ids=source, response_ids=[])
    source[0] = 99
    assert copy.prompt_ids[0] == 1, "the Triplet must not alias the caller's array"


def test_frozen_dict_pickles_and_hashes():
    frozen = FrozenDict({"a": 1})
    assert pickle.loads(pickle.dumps(frozen)) == {"a": 1}
    assert hash(frozen) == hash(FrozenDict({"a": 1}))


@settings(max_examples=100)
@given(
    input=json_values,
    metadata=st.dictionaries(st.text(max_size=5), json_values, max_size=3),
    step=st.integers(0, 10**6),
)
def test_requests_and_rows_round_trip(input, metadata, step):
    request = RolloutRequest(rollout_id="r", group_id="g", input=input, step=step, metadata=metadata)
    assert RolloutRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request
    row = TrainingRow(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        response_mask=[1, 0, 1],
        log_probs=[-0.1, 0.0, -0.2],
        reward=0.5,
        rollout_id="r",
        group_id="g",
        turn_index=1,
        response_turns=[1, 2, 2],
        turn_rewards=[None, 1.0],
    )
    assert TrainingRow.from_dict(json.loads(json.dumps(row.to_dict()))) == row
    rollout = CompletedRollout(
        rollout_id="r",
        group_id="g",
        state="succeeded",
        step=step,
        input=input,
        metadata=metadata,
        triplets=[Triplet(prompt_ids=[1], response_ids=[2], response_log_probs=[-0.3])],
        final_reward=1.0,
    )
    assert CompletedRollout.from_dict(json.loads(json.dumps(rollout.to_dict()))) == rollout
