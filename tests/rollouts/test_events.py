"""Events → completed rollout, on every recorded gateway scenario and on hand-made anomalies."""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import subprocess
import sys

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_core.data import RolloutRequest
from agl_core.rollouts.events import (
    METRICS,
    completed_rollout,
    completed_rollout_from_record,
    decode_events,
    events_by_attempt,
    last_event_time,
    parse_events,
    source_metrics,
)
from tests.helpers.paths import REPO_ROOT

SCENARIOS = [
    "multiturn_4",
    "multiturn_3_history_rewrite",
    "single_turn",
    "upstream_error_then_ok",
    "repeated_identical_prompt",
    "no_reward",
    "several_rewards_last_wins",
    "failed_rollout",
    "completions_api",
    "validation_mode",
    "tito_multiturn_prefix_stable",
]


def request_for(record: dict) -> RolloutRequest:
    return RolloutRequest(
        rollout_id=record["rollout_id"],
        group_id="g",
        input=record["input"],
        is_train=record["is_train"],
        step=2,
        sample_index=1,
    )


def expected_from_triplet_format(events_triplet: list[dict]) -> tuple[list[dict], float | None]:
    """What the gateway's own triplet view says: successful calls and the last reward."""
    calls = [
        e["data"]
        for e in events_triplet
        if e["event_type"] == "model_request"
        and e["data"].get("status") != "error"
        and e["data"].get("http_status", 200) < 400
        and e["data"]["response_token_ids"]
    ]
    rewards = [e["data"]["value"] for e in events_triplet if e["event_type"] == "reward"]
    return calls, (rewards[-1] if rewards else None)


def test_all_recorded_scenarios_are_covered(gateway_traces):
    assert sorted(gateway_traces) == sorted(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_raw_parsing_agrees_with_the_gateway_triplet_view(gateway_traces, name):
    scenario = gateway_traces[name]
    record = scenario["rollout"]["rollout"]
    rollout, counts = completed_rollout_from_record(
        request_for(record), record, scenario["events"], reward_fillna_value=-1.0
    )
    calls, reward = expected_from_triplet_format(scenario["events_triplet"])
    assert rollout.state == record["status"]["state"]
    assert rollout.group_id == "g" and rollout.step == 2 and rollout.sample_index == 1
    assert rollout.ended_at == record["status"]["updated_at"]
    assert rollout.queued_at == record["status"]["created_at"]
    assert rollout.started_at == min(e["timestamp"] for e in scenario["events"])
    assert rollout.final_reward == (reward if reward is not None else -1.0)
    if name == "repeated_identical_prompt":
        # The triplet view keeps the last of two identical prompts; both calls are real samples.
        assert len(rollout.triplets) == len(calls) + 1
        assert np.array_equal(rollout.triplets[0].prompt_ids, rollout.triplets[1].prompt_ids)
        calls = [calls[0], calls[0]]
    assert len(rollout.triplets) == len(calls)
    for triplet, call in zip(rollout.triplets, calls[-len(rollout.triplets) :] if calls else []):
        if name != "repeated_identical_prompt":
            assert triplet.prompt_ids.tolist() == call["prompt_token_ids"]
            assert triplet.response_ids.tolist() == call["response_token_ids"]
            if call["response_log_probs"] is None:
                assert triplet.response_log_probs is None
            else:
                assert np.allclose(triplet.response_log_probs, call["response_log_probs"])
        assert triplet.metadata["model_version"] == 3
    assert set(counts) <= set(METRICS)
    assert counts["training/events/n_calls"] == sum(e["event_type"] == "model_request" for e in scenario["events"])


def test_specific_scenarios(gateway_traces):
    def parsed(name):
        return parse_events(gateway_traces[name]["events"])

    assert parsed("several_rewards_last_wins").final_reward == 0.9
    assert parsed("no_reward").final_reward is None
    error = parsed("upstream_error_then_ok")
    assert error.counts["training/events/n_failed_calls"] == 1 and len(error.triplets) == 2
    assert [t.metadata["call_index"] for t in error.triplets] == [1, 2]
    val = parsed("validation_mode")
    assert val.triplets[0].response_log_probs is None
    assert val.counts["training/events/n_calls_wo_log_probs"] == 1
    comp = parsed("completions_api")
    assert len(comp.triplets[0].prompt_ids) == 5 and comp.triplets[0].response_log_probs is not None


def test_missing_reward_is_filled_and_counted(gateway_traces):
    scenario = gateway_traces["no_reward"]
    record = scenario["rollout"]["rollout"]
    rollout, counts = completed_rollout_from_record(
        request_for(record), record, scenario["events"], reward_fillna_value=0.25
    )
    assert rollout.final_reward == 0.25
    assert counts["training/n_rollouts_reward_filled"] == 1 and counts["training/n_rollouts_w_reward"] == 0


def _events(gateway_traces, name="single_turn"):
    return copy.deepcopy(gateway_traces[name]["events"])


@pytest.mark.parametrize("value", [True, False, "1.0", None, float("nan"), float("inf"), [1.0], {"v": 1}])
def test_bad_reward_values_are_refused_and_counted(gateway_traces, value):
    events = _events(gateway_traces)
    events.append({"event_type": "reward", "attempt_id": "0", "timestamp": 1.0, "data": {"value": value}})
    parsed = parse_events(events)
    assert parsed.final_reward == 0.5  # the last *valid* reward
    assert parsed.counts["training/events/n_bad_rewards"] == 1


def test_integer_reward_is_accepted(gateway_traces):
    events = _events(gateway_traces)
    events.append({"event_type": "reward", "data": {"value": 2}})
    assert parse_events(events).final_reward == 2.0


def _model_request(events):
    return next(e for e in events if e["event_type"] == "model_request")


@pytest.mark.parametrize(
    "corrupt, metric",
    [
        (lambda r: r.pop("prompt_token_ids"), "training/events/n_calls_missing_token_ids"),
        (lambda r: r["choices"][0].pop("token_ids"), "training/events/n_calls_missing_token_ids"),
        (lambda r: r.update(choices=[]), "training/events/n_calls_missing_token_ids"),
        (lambda r: r.update(prompt_token_ids="1 2 3"), "training/events/n_calls_garbled_token_ids"),
        (lambda r: r["choices"][0].update(token_ids=[1, -4, 2]), "training/events/n_calls_garbled_token_ids"),
        (lambda r: r["choices"][0].update(token_ids=[1, 2.5]), "training/events/n_calls_garbled_token_ids"),
        (lambda r: r["choices"][0].update(token_ids=[True, 3]), "training/events/n_calls_garbled_token_ids"),
        (lambda r: r["choices"][0].update(token_ids=[]), "training/events/n_calls_empty_response"),
    ],
)
def test_unusable_token_ids_drop_the_call_and_are_counted(gateway_traces, corrupt, metric):
    events = _events(gateway_traces)
    corrupt(_model_request(events)["data"]["response"])
    parsed = parse_events(events)
    assert parsed.triplets == ()
    assert parsed.counts[metric] == 1


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), "x", 0.5, None])
def test_unusable_log_probs_keep_the_call_without_log_probs(gateway_traces, bad):
    events = _events(gateway_traces)
    _model_request(events)["data"]["response"]["choices"][0]["logprobs"]["content"][3]["logprob"] = bad
    parsed = parse_events(events)
    assert len(parsed.triplets) == 1 and parsed.triplets[0].response_log_probs is None
    assert parsed.counts["training/events/n_calls_bad_log_probs"] == 1


def test_log_prob_count_mismatch_is_counted(gateway_traces):
    events = _events(gateway_traces, "completions_api")
    _model_request(events)["data"]["response"]["choices"][0]["logprobs"]["token_logprobs"].pop()
    parsed = parse_events(events)
    assert parsed.triplets[0].response_log_probs is None
    assert parsed.counts["training/events/n_calls_bad_log_probs"] == 1


def test_per_call_rewards_follow_call_index(gateway_traces):
    events = _events(gateway_traces, "upstream_error_then_ok")
    events += [
        {"event_type": "reward", "data": {"value": 0.1, "call_index": 2}},
        {"event_type": "reward", "data": {"value": 0.3, "call_index": 2}},  # last wins
        {"event_type": "reward", "data": {"value": 0.7, "call_index": 0}},  # the failed call: orphan
        {"event_type": "reward", "data": {"value": 0.7, "call_index": 9}},  # no such call
        {"event_type": "reward", "data": {"value": 0.7, "call_index": "1"}},
        {"event_type": "reward", "data": {"value": 0.7, "call_index": True}},
    ]
    parsed = parse_events(events)
    assert [t.reward for t in parsed.triplets] == [None, pytest.approx(0.3)]
    assert parsed.final_reward == 1.0  # per-call rewards never replace the rollout's reward
    assert parsed.counts["training/events/n_orphan_call_rewards"] == 1
    assert parsed.counts["training/events/n_bad_reward_call_index"] == 3


def test_malformed_and_other_events_are_counted(gateway_traces):
    events = _events(gateway_traces) + [
        "junk",
        {"data": {}},
        {"event_type": "model_request", "data": "junk"},
        {"event_type": "reward", "data": None},
        {"event_type": "judge_note", "data": {"text": "ok"}},
    ]
    parsed = parse_events(events)
    assert len(parsed.triplets) == 1
    assert parsed.counts["training/events/n_malformed_events"] == 3
    assert parsed.counts["training/events/n_bad_rewards"] == 1
    assert parsed.counts["training/events/n_other_events"] == 1


def test_failed_call_variants(gateway_traces):
    for change in ({"status": "error"}, {"http_status": 503}):
        events = _events(gateway_traces)
        _model_request(events)["data"].update(change)
        parsed = parse_events(events)
        assert parsed.triplets == () and parsed.counts["training/events/n_failed_calls"] == 1


def test_parsing_never_mutates_its_input(gateway_traces):
    events = _events(gateway_traces, "multiturn_4")
    before = copy.deepcopy(events)
    parse_events(events)
    assert events == before


def test_events_by_attempt_groups_in_order():
    events = [{"attempt_id": "0", "n": 1}, {"attempt_id": "1", "n": 2}, {"attempt_id": "0", "n": 3}, {"n": 4}]
    assert events_by_attempt(events, "7") == {
        "0": [events[0], events[2]],
        "1": [events[1]],
        "7": [events[3]],
    }
    assert events_by_attempt([], "3") == {"3": []}


def test_bad_fill_value_names_the_key():
    request = RolloutRequest(rollout_id="r", group_id="g", input={})
    with pytest.raises(ValueError, match="reward_fillna_value"):
        completed_rollout(request, [], state="succeeded", reward_fillna_value=math.nan)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2000) | st.floats(allow_nan=True) | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["value", "call_index", "x"]), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(
    reward=json_values,
    prompt=json_values,
    token_ids=json_values,
    logprobs=json_values,
)
def test_arbitrary_garbage_never_raises_and_is_accounted_for(gateway_traces, reward, prompt, token_ids, logprobs):
    events = _events(gateway_traces)
    response = _model_request(events)["data"]["response"]
    response["prompt_token_ids"] = prompt
    response["choices"][0]["token_ids"] = token_ids
    response["choices"][0]["logprobs"] = logprobs
    events.append({"event_type": "reward", "data": reward if isinstance(reward, dict) else {"value": reward}})
    parsed = parse_events(events)
    counts = parsed.counts
    dropped_call = sum(
        counts[f"training/events/{m}"]
        for m in ("n_calls_missing_token_ids", "n_calls_garbled_token_ids", "n_calls_empty_response")
    )
    assert len(parsed.triplets) + dropped_call == 1
    if parsed.triplets:
        lp = parsed.triplets[0].response_log_probs
        assert lp is None or (np.isfinite(lp).all() and (lp <= 0).all())
    data = reward if isinstance(reward, dict) else {"value": reward}
    refused = sum(
        counts[f"training/events/{m}"] for m in ("n_bad_rewards", "n_bad_reward_call_index", "n_orphan_call_rewards")
    )
    per_call = sum(t.reward is not None for t in parsed.triplets)
    became_final = "call_index" not in data and refused == 0 and parsed.final_reward == data.get("value")
    assert refused + per_call + became_final == 1


# Parses every recorded scenario from its body's bytes with msgspec importable or not, and prints the
# pickled (triplets, final reward, counts) of each.
_PARSE_BODIES = """
import pickle, sys
if sys.argv[1] == "hidden":
    sys.modules["msgspec"] = None  # import msgspec -> ImportError
from agl_core.rollouts import events
assert (events.msgspec is None) == (sys.argv[1] == "hidden")
bodies = pickle.load(sys.stdin.buffer)
parsed = [events.parse_events(events.decode_events(b, only_parsed_fields=True)) for b in bodies]
sys.stdout.buffer.write(pickle.dumps([(p.triplets, p.final_reward, p.counts) for p in parsed]))
"""


def test_the_same_triplets_come_out_with_or_without_msgspec(gateway_traces):
    bodies = [json.dumps(gateway_traces[name]["events"]).encode() for name in SCENARIOS]
    runs = {}
    for msgspec in ("importable", "hidden"):
        done = subprocess.run(
            [sys.executable, "-c", _PARSE_BODIES, msgspec],
            input=pickle.dumps(bodies),
            capture_output=True,
            check=True,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        runs[msgspec] = pickle.loads(done.stdout)
    assert runs["importable"] == runs["hidden"]
    assert [len(t) for t, _, _ in runs["hidden"]] == [
        len(parse_events(gateway_traces[n]["events"]).triplets) for n in SCENARIOS
    ]


def test_decoding_only_the_parsed_fields_skips_the_rest(gateway_traces):
    body = json.dumps(gateway_traces["multiturn_4"]["events"]).encode()
    full, parsed = decode_events(body), decode_events(body, only_parsed_fields=True)
    call = parsed[0]["data"]
    assert "rollout_id" not in parsed[0] and set(call["request"]) == {"messages"}  # the rest of the request skipped
    assert bytes(call["request"]["messages"]) and not isinstance(call["request"]["messages"], list)  # undecoded
    assert set(call["response"]["choices"][0]["logprobs"]["content"][0]) == {"logprob"}
    assert parse_events(parsed) == parse_events(full)
    # What msgspec refuses and the standard library accepts is decoded by the latter.
    assert math.isnan(
        decode_events(b'[{"event_type": "reward", "data": {"value": NaN}}]', only_parsed_fields=True)[0]["data"][
            "value"
        ]
    )
    with pytest.raises(ValueError):
        decode_events(b'[{"event_type": ')


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def _with_messages(gateway_traces, messages):
    events = _events(gateway_traces)
    _model_request(events)["data"]["request"] = {"model": "m", "messages": messages}
    return events


@pytest.mark.parametrize("decode", ["full", "parsed_fields"])
@pytest.mark.parametrize(
    "content",
    [
        [{"type": "text", "text": "what is shown?"}, IMAGE],
        json.dumps([IMAGE, IMAGE]),  # some clients send the parts as JSON text
    ],
    ids=["parts", "json-text"],
)
def test_a_training_call_reads_its_images_in_order_and_a_validation_call_does_not(gateway_traces, decode, content):
    events = _with_messages(gateway_traces, [{"role": "user", "content": content}])
    body = json.dumps(events).encode()
    decoded = decode_events(body, only_parsed_fields=decode == "parsed_fields")
    request = RolloutRequest(rollout_id="vl-1", group_id="g", input={}, is_train=True)
    rollout, _ = completed_rollout(request, decoded, state="succeeded", reward_fillna_value=0.0)
    n_images = 1 if isinstance(content, list) else 2
    assert rollout.triplets[0].image_urls == (IMAGE["image_url"]["url"],) * n_images
    validation = attrs.evolve(request, is_train=False)  # measured, never trained: images not read
    rollout, _ = completed_rollout(validation, decoded, state="succeeded", reward_fillna_value=0.0)
    assert len(rollout.triplets) == 1 and rollout.triplets[0].image_urls == ()


@pytest.mark.parametrize("decode", ["full", "parsed_fields"])
def test_text_that_mentions_image_url_is_not_an_image(gateway_traces, decode):
    events = _with_messages(
        gateway_traces,
        [{"role": "user", "content": 'set "type": "image_url" in the request'}, {"role": "assistant", "content": None}],
    )
    decoded = decode_events(json.dumps(events).encode(), only_parsed_fields=decode == "parsed_fields")
    triplets = parse_events(decoded).triplets
    assert len(triplets) == 1 and triplets[0].image_urls == ()


def test_the_last_event_time_skips_unusable_timestamps():
    events = [{"timestamp": 1.5}, {"timestamp": 3.25}, {"timestamp": True}, {"timestamp": "soon"}, {}, "junk"]
    assert last_event_time(events) == 3.25
    assert last_event_time([{"timestamp": float("nan")}]) is None and last_event_time([]) is None


def test_source_metrics_give_the_rate_over_the_interval_and_the_pickup_summary():
    assert source_metrics(6, 2.0, [0.5, 1.5, 1.0]) == {
        "timing/rollout_source/interval_s": 2.0,
        "timing/rollout_source/rollouts_per_s": 3.0,
        "timing/rollout_source/pickup_s/mean": 1.0,
        "timing/rollout_source/pickup_s/p50": 1.0,
        "timing/rollout_source/pickup_s/p90": pytest.approx(1.4),
        "timing/rollout_source/pickup_s/max": 1.5,
    }
    assert source_metrics(0, 0.0, []) == {
        "timing/rollout_source/interval_s": 0.0,
        "timing/rollout_source/rollouts_per_s": 0.0,
    }
