"""Hostile events never stop training: any JSON value in any field of a recorded rollout's events (or
its record's times) is either used, or skipped and counted; the parser never raises."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl_core.data import CompletedRollout, RolloutRequest, Triplet
from agl_core.rollouts.events import METRICS, completed_rollout_from_record, decode_events, parse_events
from agl_core.stages.vocabulary import within_vocabulary

SCENARIOS = ["multiturn_4", "completions_api", "upstream_error_then_ok", "several_rewards_last_wins"]

# What JSON decoding can produce, with the edges that once crashed the parser: integers beyond int64
# and beyond float range, non-finite floats, booleans where numbers belong.
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**400, -(10**400), 0, 1, 33, 34, 10**6])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=4)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every place in a JSON document a value can be swapped in (the document itself excluded)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


def _replace(document: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        document = document[key]
    document[path[-1]] = value


def _request(record: dict) -> RolloutRequest:
    return RolloutRequest(rollout_id=record["rollout_id"], group_id="g", input=record["input"], step=3)


def _check_rollout(rollout: CompletedRollout, counts) -> None:
    assert set(counts) <= set(METRICS), set(counts) - set(METRICS)
    for triplet in rollout.triplets:
        for ids in (triplet.prompt_ids, triplet.response_ids):
            assert ids.dtype == np.int64 and (ids >= 0).all()
        assert len(triplet.prompt_ids) and len(triplet.response_ids)
        lp = triplet.response_log_probs
        assert lp is None or (len(lp) == len(triplet.response_ids) and np.isfinite(lp).all() and (lp <= 0).all())
    for stamp in (rollout.queued_at, rollout.started_at, rollout.ended_at):
        assert stamp is None or np.isfinite(stamp)
    assert np.isfinite(rollout.final_reward)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), scenario=st.sampled_from(SCENARIOS), n_changes=st.integers(1, 4))
def test_any_json_value_in_any_field_is_used_or_counted_never_raised(gateway_traces, data, scenario, n_changes):
    recorded = gateway_traces[scenario]
    events = copy.deepcopy(recorded["events"])
    record = copy.deepcopy(recorded["rollout"]["rollout"])
    for _ in range(n_changes):
        path = data.draw(st.sampled_from(list(_paths(events))), label="event path")
        _replace(events, path, data.draw(json_values, label="value"))
    for stamp in ("created_at", "updated_at"):  # the record's times; its state is the source's to check
        record["status"][stamp] = data.draw(st.one_of(st.just(record["status"][stamp]), json_values), label=stamp)
    rollout, counts = completed_rollout_from_record(
        _request(recorded["rollout"]["rollout"]), record, events, reward_fillna_value=0.0
    )
    _check_rollout(rollout, counts)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(json_values, max_size=6))
def test_any_json_document_as_the_event_list_never_raises(events):
    parsed = parse_events(events)
    assert set(parsed.counts) <= set(METRICS)


def _first_call(events: list[dict]) -> dict:
    return next(e for e in events if e["event_type"] == "model_request")["data"]["response"]


@pytest.mark.parametrize(
    "token_id", [2**63, 2**64, 10**400, -(2**63) - 1], ids=["2**63", "2**64", "10**400", "-2**63-1"]
)
@pytest.mark.parametrize("where", ["prompt", "response"])
def test_token_ids_beyond_int64_are_garbled_and_counted(gateway_traces, token_id, where):
    events = copy.deepcopy(gateway_traces["single_turn"]["events"])
    response = _first_call(events)
    ids = response["prompt_token_ids"] if where == "prompt" else response["choices"][0]["token_ids"]
    ids[1] = token_id
    parsed = parse_events(events)
    assert parsed.triplets == () and parsed.counts["training/events/n_calls_garbled_token_ids"] == 1


@pytest.mark.parametrize("value", [10**400, -(10**400)], ids=["10**400", "-10**400"])
def test_rewards_and_log_probs_beyond_float_range_are_refused_and_counted(gateway_traces, value):
    events = copy.deepcopy(gateway_traces["single_turn"]["events"])
    _first_call(events)["choices"][0]["logprobs"]["content"][0]["logprob"] = value
    events.append({"event_type": "reward", "data": {"value": value}})
    events.append({"event_type": "reward", "data": {"value": 1.0, "call_index": 0}})
    events.append({"event_type": "reward", "data": {"value": value, "call_index": 0}})
    parsed = parse_events(events)
    assert parsed.final_reward == 0.5  # the recorded one: the huge value is not the last *valid* reward
    assert parsed.triplets[0].response_log_probs is None and parsed.triplets[0].reward == 1.0
    assert parsed.counts["training/events/n_calls_bad_log_probs"] == 1
    assert parsed.counts["training/events/n_bad_rewards"] == 2


@pytest.mark.parametrize(
    "stamp",
    [float("nan"), float("inf"), True, "noon", 10**400, [1.0]],
    ids=["nan", "inf", "true", "str", "10**400", "list"],
)
def test_unusable_timestamps_are_ignored_and_counted(gateway_traces, stamp):
    recorded = gateway_traces["multiturn_4"]
    events = copy.deepcopy(recorded["events"])
    good = [e["timestamp"] for e in events[1:]]
    events[0]["timestamp"] = stamp
    record = copy.deepcopy(recorded["rollout"]["rollout"])
    record["status"]["created_at"] = stamp
    rollout, counts = completed_rollout_from_record(_request(record), record, events, reward_fillna_value=0.0)
    assert rollout.started_at == min(good) and rollout.queued_at is None
    assert counts["training/events/n_bad_timestamps"] == 2


@pytest.mark.parametrize("version", [10**400, -1, True, "3", 2.0], ids=["10**400", "-1", "true", "str", "float"])
def test_unusable_model_versions_are_unknown_not_kept(gateway_traces, version):
    events = copy.deepcopy(gateway_traces["single_turn"]["events"])
    data = next(e for e in events if e["event_type"] == "model_request")["data"]
    data.setdefault("server", {})["version"] = version
    assert parse_events(events).triplets[0].metadata["model_version"] is None


def _rollout(*triplets: Triplet) -> CompletedRollout:
    return CompletedRollout(rollout_id="r", group_id="g", state="succeeded", triplets=triplets, final_reward=1.0)


def test_calls_outside_the_vocabulary_are_removed_and_counted():
    ok = Triplet(prompt_ids=[1, 2, 33], response_ids=[4, 5])
    bad_prompt = Triplet(prompt_ids=[1, 34], response_ids=[4])
    bad_response = Triplet(prompt_ids=[1], response_ids=[4, 1_000_000])
    clean = _rollout(ok)
    kept, removed = within_vocabulary([_rollout(ok, bad_prompt, ok, bad_response), clean], vocab_size=34)
    assert removed == 2
    assert kept[0].triplets == (ok, ok) and kept[1] is clean
    assert within_vocabulary([clean], vocab_size=33) == ([_rollout()], 1)


def _same(rollout: CompletedRollout) -> str:
    """A rollout as comparable text (NaN, which a metadata value may hold, is equal to itself here)."""
    return json.dumps(rollout.to_dict(), sort_keys=True, default=repr)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), scenario=st.sampled_from(SCENARIOS), n_changes=st.integers(0, 4))
def test_decoding_only_the_parsed_fields_reads_what_a_full_decode_reads(gateway_traces, data, scenario, n_changes):
    """Whatever an events body holds, decoding only the fields the parser reads gives the rollout and
    the counts that the standard library's full decode gives (bodies of another shape, or that
    msgspec refuses, are decoded in full)."""
    recorded = gateway_traces[scenario]
    events = copy.deepcopy(recorded["events"])
    for _ in range(n_changes):
        path = data.draw(st.sampled_from(list(_paths(events))), label="event path")
        _replace(events, path, data.draw(json_values, label="value"))
    body = json.dumps(events).encode()
    record, request = recorded["rollout"]["rollout"], _request(recorded["rollout"]["rollout"])
    full, full_counts = completed_rollout_from_record(request, record, json.loads(body), reward_fillna_value=0.0)
    fast, fast_counts = completed_rollout_from_record(
        request, record, decode_events(body, only_parsed_fields=True), reward_fillna_value=0.0
    )
    assert _same(fast) == _same(full) and fast_counts == full_counts
