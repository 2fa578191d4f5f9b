"""The gateway retry policy: what is retried, for which calls, and how long it waits."""

from __future__ import annotations

import httpx
import pytest

from agl_core.config import load_config
from agl_core.rollouts.gateway_client import GatewayError
from agl_core.rollouts.retry import RetryPolicy


def error(status: int | None, *, ambiguous: bool = False) -> GatewayError:
    return GatewayError("POST /x", status, "boom", ambiguous=ambiguous)


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 599])
def test_idempotent_calls_retry_transient_answers(status):
    assert RetryPolicy().is_retryable(error(status))


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 422])
def test_client_errors_are_final(status):
    assert not RetryPolicy().is_retryable(error(status))
    assert not RetryPolicy().is_retryable(error(status), idempotent=False)


def test_calls_that_are_not_idempotent_retry_only_what_was_provably_not_applied():
    policy = RetryPolicy()
    assert [s for s in (408, 429, 500, 502, 503, 504) if policy.is_retryable(error(s), idempotent=False)] == [
        408,
        429,
        503,
    ]
    assert policy.is_retryable(error(None), idempotent=False)  # never sent
    assert not policy.is_retryable(error(None, ambiguous=True), idempotent=False)
    assert policy.is_retryable(error(None, ambiguous=True))  # an idempotent call may be sent twice


def test_unsent_errors():
    policy, request = RetryPolicy(), httpx.Request("GET", "http://127.0.0.1:1/")
    assert policy.unsent(httpx.ConnectError("refused", request=request))
    assert not policy.unsent(httpx.ReadTimeout("slow", request=request))


def test_backoff_doubles_is_capped_and_jittered():
    policy = RetryPolicy(backoff_seconds=1.0, backoff_max_seconds=5.0)
    for retry, full in [(0, 1.0), (1, 2.0), (2, 4.0), (3, 5.0), (10, 5.0)]:
        waits = [policy.backoff(retry) for _ in range(50)]
        assert all(full * 0.5 <= w <= full for w in waits)


def test_built_from_the_gateway_config_keys():
    cfg = load_config(
        overrides=[
            "agentlightning.gateway.max_retries=3",
            "agentlightning.gateway.retry_backoff_seconds=0.25",
            "agentlightning.gateway.retry_backoff_max_seconds=2",
        ]
    )
    assert RetryPolicy.from_config(cfg) == RetryPolicy(max_retries=3, backoff_seconds=0.25, backoff_max_seconds=2.0)
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)


def test_run_retries_until_success_counting_each_retry():
    outcomes = iter([error(503), error(None), {"ok": True}])
    retried = []

    def attempt():
        outcome = next(outcomes)
        if isinstance(outcome, GatewayError):
            raise outcome
        return outcome

    assert RetryPolicy(backoff_seconds=0.0).run(attempt, on_retry=lambda: retried.append(1)) == {"ok": True}
    assert len(retried) == 2


@pytest.mark.parametrize(
    ("failure", "idempotent", "attempts", "transient"),
    [
        (error(503), True, 3, True),  # the attempts ran out on a transient failure
        (error(500), False, 1, True),  # not retried (it may have been applied), yet transient
        (error(404), True, 1, False),  # final at once
        (error(None, ambiguous=True), False, 1, True),
    ],
)
def test_run_marks_the_error_it_gives_up_on_transient_or_final(failure, idempotent, attempts, transient):
    calls = []

    def attempt():
        calls.append(1)
        raise failure

    with pytest.raises(GatewayError) as raised:
        RetryPolicy(max_retries=2, backoff_seconds=0.0).run(attempt, idempotent=idempotent)
    assert raised.value is failure and len(calls) == attempts and raised.value.transient is transient


def test_the_defaults_are_the_config_schema_s():
    from agl_core.config import default_config
    from agl_core.rollouts.gateway_client import GatewayClient

    assert RetryPolicy() == RetryPolicy.from_config(default_config())
    with GatewayClient("http://127.0.0.1:1") as client:
        assert client._http.timeout.read == default_config().agentlightning.gateway.http_timeout_seconds
