"""A training call's images: read from its request messages onto the Triplet, in order, and refused or
counted by the parser's rules when they cannot be trained on."""

from __future__ import annotations

import json

import pytest

from agl_core.data import CompletedRollout, DataValidationError, RolloutRequest, Triplet
from agl_core.rollouts.events import completed_rollout, decode_events, parse_events
from tests.helpers import vision_rows as v

DECODES = ["full", "parsed_fields"]


def decoded(events, decode):
    return decode_events(json.dumps(events).encode(), only_parsed_fields=decode == "parsed_fields")


def one_call(content, extra_messages=()):
    messages = [*extra_messages, {"role": "user", "content": content}]
    return [v.model_request(messages, [1, 2, 3], [4, 5])]


@pytest.mark.parametrize("decode", DECODES)
def test_the_two_turn_chat_calls_carry_their_images_in_order(decode):
    parsed = parse_events(decoded(v.chat_events(v.chat_calls()), decode))
    assert [t.image_urls for t in parsed.triplets] == [(v.URL_A,), (v.URL_A, v.URL_B)]
    assert not parsed.counts["training/events/n_calls_bad_images"]


@pytest.mark.parametrize("decode", DECODES)
def test_every_part_form_is_read_across_messages(decode):
    a, b, c = (f"data:image/png;base64,{x}" for x in ("QQ==", "Qg==", "Qw=="))
    system = {"role": "system", "content": [{"type": "image_url", "image_url": {"url": a}}]}
    parts = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": b}]
    json_text = {"role": "user", "content": json.dumps([{"type": "image_url", "image_url": {"url": c}}])}
    events = one_call(parts, [system])
    events[0]["data"]["request"]["messages"].append(json_text)
    [triplet] = parse_events(decoded(events, decode)).triplets
    assert triplet.image_urls == (a, b, c)


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://10.0.0.1/x.jpg"])
def test_a_network_image_is_refused_naming_the_call_and_rollout(decode, url):
    events = one_call([{"type": "image_url", "image_url": {"url": v.URL_A}}, {"type": "image_url", "image_url": url}])
    request = RolloutRequest(rollout_id="vl-http", group_id="g", input={})
    with pytest.raises(DataValidationError, match="network") as info:
        completed_rollout(request, decoded(events, decode), state="succeeded", reward_fillna_value=0.0)
    assert info.value.rollout_id == "vl-http" and info.value.field == "calls[0].image_urls[1]"


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize(
    "part",
    [{"type": "image_url"}, {"type": "image_url", "image_url": {"uri": "x"}}, {"type": "image_url", "image_url": 7}],
    ids=["no-image_url", "no-url", "not-a-string"],
)
def test_an_image_part_without_a_url_leaves_the_call_out_counted(decode, part):
    events = one_call([part]) + one_call("plain text")
    parsed = parse_events(decoded(events, decode))
    assert len(parsed.triplets) == 1 and parsed.triplets[0].metadata["call_index"] == 1
    assert parsed.counts["training/events/n_calls_bad_images"] == 1


def test_a_validation_rollout_reads_no_images():
    events = one_call([{"type": "image_url", "image_url": "https://example.com/cat.png"}])
    request = RolloutRequest(rollout_id="val", group_id="g", input={}, is_train=False)
    rollout, counts = completed_rollout(request, events, state="succeeded", reward_fillna_value=0.0)
    assert rollout.triplets[0].image_urls == () and not counts["training/events/n_calls_bad_images"]


def test_image_urls_round_trip_and_old_records_load():
    triplet = Triplet(prompt_ids=[1], response_ids=[2], image_urls=[v.URL_A, "/data/b.png", "file:///c.png"])
    data = json.loads(json.dumps(triplet.to_dict()))
    assert data["image_urls"] == [v.URL_A, "/data/b.png", "file:///c.png"]
    assert Triplet.from_dict(data) == triplet
    text = Triplet(prompt_ids=[1], response_ids=[2])
    assert "image_urls" not in text.to_dict()  # a text call is recorded as before
    rollout = CompletedRollout(rollout_id="r", group_id="g", state="succeeded", triplets=[text.to_dict()])
    assert CompletedRollout.from_dict(rollout.to_dict()).triplets[0].image_urls == ()


@pytest.mark.parametrize(
    ("urls", "field", "why"),
    [
        (["https://x/y.png"], "image_urls[0]", "network"),
        ([v.URL_A, ""], "image_urls[1]", "non-empty string"),
        ([v.URL_A, "cat.png"], "image_urls[1]", "not an image URL"),
        (["data:text/plain;base64,QQ=="], "image_urls[0]", "not a base64 image"),
        ("data:image/png;base64,QQ==", "image_urls", "sequence of image URLs"),
    ],
)
def test_unloadable_image_urls_are_refused_by_name(urls, field, why):
    with pytest.raises(DataValidationError, match=why) as info:
        Triplet(prompt_ids=[1], response_ids=[2], image_urls=urls)
    assert info.value.field == field
