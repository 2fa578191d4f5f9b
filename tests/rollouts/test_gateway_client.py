"""The gateway client against the real ``agl-server``: every endpoint, auth, errors and retries."""

from __future__ import annotations

import logging

import pytest

from agl_core.data import RolloutRequest
from agl_core.rollouts.gateway_client import GatewayClient, GatewayError
from agl_core.rollouts.retry import RetryPolicy
from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.gateway_fixtures import good_call, list_rollouts, patch_rollout
from tests.helpers.gateway_server import MODEL_NAME

pytestmark = pytest.mark.gateway


def request(rid: str, **kwargs) -> RolloutRequest:
    return RolloutRequest(rollout_id=rid, group_id="grp", input={"q": rid}, config={"timeout_seconds": 9}, **kwargs)


@pytest.fixture
def client(gateway):
    with GatewayClient(
        gateway.url, gateway.key, timeout_seconds=2, retry=RetryPolicy(max_retries=2, backoff_seconds=0.01)
    ) as c:
        yield c


@pytest.fixture
def proxy(gateway):
    with FaultProxy(gateway.port) as p:
        yield p


def via(proxy, gateway, max_retries: int = 2, timeout_seconds: float = 30.0) -> GatewayClient:
    """A client through the fault proxy: only a ``stall`` outlasts its timeout, never a loaded machine."""
    return GatewayClient(
        proxy.url,
        gateway.key,
        timeout_seconds=timeout_seconds,
        retry=RetryPolicy(max_retries=max_retries, backoff_seconds=0.01),
    )


def test_rollout_lifecycle_round_trip(client):
    created = client.create_rollouts([request("c1", step=3, sample_index=1), request("c2")])
    assert [r["rollout_id"] for r in created] == ["c1", "c2"]
    assert created[0]["metadata"]["group_id"] == "grp" and created[0]["metadata"]["step"] == 3
    assert created[0]["config"]["timeout_seconds"] == 9
    # Re-posting a known id returns the stored rollout untouched: creation is idempotent.
    patch_rollout(client, "c1", state="running", last_attempt_id="0")
    again = client.create_rollouts([request("c1")])
    assert again[0]["status"]["state"] == "running"
    assert {r["rollout_id"] for r in list_rollouts(client, ["running"])} >= {"c1"}
    before = client.terminal_page(0)["total_terminal"]
    client.append_event("c1", "0", *good_call())
    client.append_event("c1", "0", "reward", {"value": 0.5})
    patch_rollout(client, "c1", state="succeeded")
    page = client.terminal_page(before)
    assert [i["rollout_id"] for i in page["items"]] == ["c1"] and page["next_after"] == before + 1
    assert client.terminal_page(page["next_after"])["items"] == []
    raw = client.get_events("c1")
    assert [e["event_type"] for e in raw] == ["model_request", "reward"]
    parsed_fields = client.get_events("c1", only_parsed_fields=True)
    assert parsed_fields[0]["data"]["response"]["choices"][0]["token_ids"] == [4, 5]
    assert "model" in raw[0]["data"]["request"] and set(parsed_fields[0]["data"]["request"]) == {"messages"}
    assert "model" not in parsed_fields[0]["data"]  # what the parser does not read is skipped
    with pytest.raises(ValueError, match="only_parsed_fields"):
        client.get_events("c1", triplet=True, only_parsed_fields=True)
    triplet = client.get_events("c1", triplet=True)
    assert triplet[0]["data"]["response_token_ids"] == [4, 5]
    assert client.get_events("c1", event_type="reward")[0]["data"] == {"value": 0.5}
    detail = client.get_rollout("c1")
    assert detail["rollout"]["status"]["state"] == "succeeded" and detail["attempts"] == ["0"]
    client.delete_rollout("c1")
    client.delete_rollout("c1")  # idempotent
    with pytest.raises(GatewayError) as err:
        client.get_rollout("c1")
    assert err.value.status == 404 and err.value.not_found
    assert err.value.endpoint == "GET /api/rollouts/c1" and "Rollout not found" in err.value.message


def test_models_and_proxy_management(client):
    registered = client.register_models(MODEL_NAME, ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"], 7)
    assert {m["version"] for m in registered} == {7}
    client.delete_models()
    state = client.pause(3, "weight update")
    assert state["paused"] and state["retry_after_seconds"] == 3
    assert client.proxy_state()["paused"]
    assert not client.resume()["paused"]
    assert client.healthy()


def test_client_errors_are_not_retried_and_say_what_failed(client):
    client.create_rollouts([request("c4xx")])
    sent = sum(client.requests_sent.values())
    with pytest.raises(GatewayError) as err:
        patch_rollout(client, "c4xx", state="succeeded")  # queuing -> succeeded is illegal
    assert err.value.status == 409 and "cannot transition" in err.value.message
    with pytest.raises(GatewayError) as err:
        patch_rollout(client, "c4xx", state="exploded")
    assert err.value.status == 422
    assert sum(client.requests_sent.values()) == sent + 2
    assert not client.retries


def test_the_key_never_shows(gateway, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = GatewayClient(gateway.url, "not-the-key-123", retry=RetryPolicy(max_retries=0))
    with pytest.raises(GatewayError) as err:
        wrong.terminal_page(0)
    assert err.value.status == 401 and err.value.endpoint == "GET /api/rollouts/terminal"
    good = GatewayClient(gateway.url, gateway.key)
    good.terminal_page(0)
    for text in (str(err.value), repr(err.value), repr(wrong), repr(good), caplog.text):
        assert "not-the-key-123" not in text and gateway.key not in text


def test_5xx_and_resets_are_retried_for_idempotent_calls(gateway, proxy):
    c = via(proxy, gateway)
    proxy.inject("503", 2)
    assert c.terminal_page(0)["total_terminal"] >= 0
    assert c.retries["terminal"] == 2
    proxy.inject("reset", 1)
    proxy.inject("reset_after", 1)
    c.create_rollouts([request("retry-create")])
    assert c.retries["create"] == 2
    # The create was applied by the gateway before the reset, and retried: still one rollout.
    assert [r["rollout_id"] for r in list_rollouts(c, ["queuing"]) if r["rollout_id"] == "retry-create"] == [
        "retry-create"
    ]


def test_timeouts_are_retried_then_fail_with_no_status(gateway, proxy):
    c = via(proxy, gateway, max_retries=1, timeout_seconds=0.5)  # every request it sends stalls
    proxy.inject("stall", 2)
    with pytest.raises(GatewayError) as err:
        c.terminal_page(0)
    assert err.value.status is None and "Timeout" in err.value.message
    assert c.requests_sent["terminal"] == 2


def test_event_appends_retry_only_when_provably_not_applied(gateway, proxy, client):
    client.create_rollouts([request("append")])
    c = via(proxy, gateway)
    proxy.inject("503", 1)
    c.append_event("append", "0", "reward", {"value": 0.1})
    assert c.retries["append_event"] == 1
    # A reset after the request left is ambiguous whether or not the gateway applied it: no re-send.
    for fault, value in (("reset", 0.2), ("reset_after", 0.3)):
        proxy.inject(fault, 1)
        with pytest.raises(GatewayError) as err:
            c.append_event("append", "0", "reward", {"value": value})
        assert err.value.ambiguous and err.value.status is None
    assert c.requests_sent["append_event"] == 4
    assert [e["data"]["value"] for e in client.get_events("append")] == [0.1, 0.3]


def test_event_append_with_a_position_settles_ambiguity_by_reading_back(gateway, proxy, client):
    client.create_rollouts([request("settle")])
    c = via(proxy, gateway)
    proxy.inject("reset_after", 1, path_contains="/attempt/")  # applied, answer lost: found, not re-sent
    assert c.append_event("settle", "0", "reward", {"value": 0.1}, position=0)["data"] == {"value": 0.1}
    proxy.inject("reset", 1, path_contains="/attempt/")  # not applied: not found, sent again
    c.append_event("settle", "0", "reward", {"value": 0.2}, position=1)
    assert c.requests_sent["append_event"] == 3 and c.retries["append_event"] == 1
    assert [e["data"]["value"] for e in client.get_events("settle")] == [0.1, 0.2]


def test_unreachable_gateway_fails_after_bounded_retries():
    from tests.helpers.gateway_server import free_port

    c = GatewayClient(f"http://127.0.0.1:{free_port()}", "k", retry=RetryPolicy(max_retries=2, backoff_seconds=0.01))
    with pytest.raises(GatewayError) as err:
        c.get_rollout("x")
    assert err.value.status is None and "ConnectError" in err.value.message
    assert c.requests_sent["get"] == 3
