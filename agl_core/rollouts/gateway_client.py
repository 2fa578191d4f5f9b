"""A synchronous HTTP client for the Agent Lightning gateway (``agl-server`` 1.0.x).

Every call has a timeout and is retried as its :class:`~agl_core.rollouts.retry.RetryPolicy` says.
Idempotent calls (reads, deletes, model registration, pause/resume and rollout creation, which is
idempotent because rollout ids are chosen here) are retried on timeouts, connection errors and
408/429/5xx answers. Appending an event is not idempotent: it is retried only when the server
provably did not apply it (the connection was refused, or it answered 408/429/503). An ambiguous
failure raises a :class:`GatewayError` with ``ambiguous=True``, unless the caller said where the
event belongs: then the events are read back and the event is re-sent only if it is not there.
Any other 4xx raises at once.

The key is sent as a bearer token and never appears in an error, a log line or ``repr``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import httpx
from omegaconf import DictConfig

from agl_core.config.schema import GatewayConfig
from agl_core.data import RolloutRequest
from agl_core.errors import UsageError
from agl_core.fields import thaw
from agl_core.rollouts.events import decode_events
from agl_core.rollouts.gateway_error import GatewayError
from agl_core.rollouts.retry import RetryPolicy

__all__ = ["GatewayClient", "GatewayError", "rollout_payload"]

T = TypeVar("T")


def _server_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, Mapping) and "detail" in body:
        return str(body["detail"])[:500]
    return str(body)[:500]


def rollout_payload(request: RolloutRequest) -> dict[str, Any]:
    """The ``POST /api/rollouts`` item for one request: its id, input, mode, config and metadata.

    The group id, step and sample index travel in ``metadata`` so the gateway's records say which
    group a rollout belongs to; ``input.data_id`` is left to the user's data.
    """
    metadata = {**thaw(request.metadata), "group_id": request.group_id, "step": request.step}
    metadata["sample_idx_in_batch"] = request.sample_index
    return {
        "rollout_id": request.rollout_id,
        "input": thaw(request.input),
        "is_train": request.is_train,
        "config": thaw(request.config),
        "metadata": metadata,
    }


class GatewayClient:
    """One connection pool to one gateway. ``requests_sent`` counts HTTP requests by endpoint kind."""

    def __init__(
        self,
        base_url: str,
        key: str = "",
        *,
        timeout_seconds: float = GatewayConfig.http_timeout_seconds,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_seconds, transport=transport)
        self.retry = retry or RetryPolicy()
        self.requests_sent: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()
        self._count_lock = threading.Lock()  # the client is shared by reader threads

    @classmethod
    def from_config(cls, config: DictConfig) -> GatewayClient:
        agl = config.agentlightning
        return cls(
            agl.agl_base_url,
            agl.agl_key or "",
            timeout_seconds=agl.gateway.http_timeout_seconds,
            retry=RetryPolicy.from_config(config),
        )

    def __repr__(self) -> str:
        return f"GatewayClient({self.base_url!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport ----------------------------------------------------------------------------

    def _send(self, method: str, path: str, *, kind: str, **kwargs: Any) -> httpx.Response:
        """One attempt: a successful response, or a :class:`GatewayError` that says whether the
        request may have been applied."""
        with self._count_lock:
            self.requests_sent[kind] += 1
        endpoint = f"{method} {path}"
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            message = f"{type(exc).__name__}: {exc}"
            raise GatewayError(endpoint, None, message, ambiguous=not self.retry.unsent(exc)) from exc
        if response.status_code >= 400:
            raise GatewayError(endpoint, response.status_code, _server_message(response))
        return response

    def _retrying(self, kind: str, attempt: Callable[[], T], *, idempotent: bool) -> T:
        """``attempt`` run by the retry policy's loop, each retry counted under ``kind``."""
        return self.retry.run(attempt, idempotent=idempotent, on_retry=lambda: self._count_retry(kind))

    def _count_retry(self, kind: str) -> None:
        with self._count_lock:
            self.retries[kind] += 1

    def _request(self, method: str, path: str, *, kind: str, idempotent: bool = True, **kwargs: Any) -> httpx.Response:
        """Send with retries; return a successful response or raise :class:`GatewayError`."""
        return self._retrying(kind, lambda: self._send(method, path, kind=kind, **kwargs), idempotent=idempotent)

    # -- rollouts -----------------------------------------------------------------------------

    def create_rollouts(self, requests: Sequence[RolloutRequest]) -> list[dict[str, Any]]:
        """Create rollouts with their own ids in one call (idempotent: known ids are left untouched)."""
        if not requests:
            return []
        payload = [rollout_payload(r) for r in requests]
        created = self._request("POST", "/api/rollouts", kind="create", json=payload).json()
        if len(created) != len(payload) or any(
            c.get("rollout_id") != p["rollout_id"] for c, p in zip(created, payload)
        ):
            raise GatewayError("POST /api/rollouts", 201, "the gateway answered with other rollouts than those sent")
        return created

    def get_rollout(self, rollout_id: str) -> dict[str, Any]:
        """``{"rollout": {...}, "attempts": [...]}``; a :class:`GatewayError` with status 404 if unknown."""
        return self._request("GET", f"/api/rollouts/{rollout_id}", kind="get").json()

    def terminal_page(self, after: int, limit: int = 1000) -> dict[str, Any]:
        """Rollouts that became terminal after cursor ``after``, in completion order."""
        params = {"after": after, "limit": limit}
        return self._request("GET", "/api/rollouts/terminal", kind="terminal", params=params).json()

    def delete_rollout(self, rollout_id: str) -> None:
        self._request("DELETE", f"/api/rollouts/{rollout_id}", kind="delete")

    # -- events -------------------------------------------------------------------------------

    def get_events(
        self, rollout_id: str, *, event_type: str | None = None, triplet: bool = False, only_parsed_fields: bool = False
    ) -> list[dict[str, Any]]:
        """The last attempt's events, raw (default) or in the gateway's ``format=triplet`` view.

        The body is decoded from its bytes by :func:`~agl_core.rollouts.events.decode_events`;
        ``only_parsed_fields`` keeps only what the events parser reads (for raw events), which is
        several times faster on the large bodies of long rollouts.
        """
        if triplet and only_parsed_fields:
            raise UsageError("only_parsed_fields reads raw events, not the format=triplet view")
        params = {"include_routed_experts": "false"}
        if event_type is not None:
            params["event_type"] = event_type
        if triplet:
            params["format"] = "triplet"
        response = self._request("GET", f"/api/rollouts/{rollout_id}/events", kind="events", params=params)
        return decode_events(response.content, only_parsed_fields=only_parsed_fields)

    def append_event(
        self, rollout_id: str, attempt_id: str, event_type: str, data: Mapping[str, Any], *, position: int | None = None
    ) -> dict[str, Any]:
        """Append one event to the rollout's attempt.

        ``position`` is how many events the rollout held before this one. Given it, an ambiguous
        failure is settled by reading the events back: an event found there counts as sent, one not
        found as not applied, so it is retried within the same attempts as any other.
        """
        path = f"/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"
        body = {"event_type": event_type, "data": thaw(data)}

        def attempt() -> dict[str, Any]:
            try:
                return self._send("POST", path, kind="append_event", json=body).json()
            except GatewayError as error:
                if not error.ambiguous or position is None:
                    raise
                landed = self._event_at(rollout_id, position)
                if landed is not None and (landed.get("event_type"), landed.get("data")) == (event_type, body["data"]):
                    return landed
                raise GatewayError(error.endpoint, None, f"{error.message} (not applied: read back)") from error

        return self._retrying("append_event", attempt, idempotent=False)

    def _event_at(self, rollout_id: str, position: int) -> dict[str, Any] | None:
        """The rollout's event at ``position``, or ``None`` if it has none there or cannot be read."""
        try:
            events = self.get_events(rollout_id)
        except GatewayError:
            return None
        return events[position] if len(events) > position else None

    # -- models and proxy ---------------------------------------------------------------------

    def register_models(self, model: str, endpoints: Sequence[str], version: int) -> list[dict[str, Any]]:
        """Upsert ``endpoints`` for ``model`` with ``version`` (the training step)."""
        payload = [{"model": model, "endpoint": e, "version": int(version)} for e in endpoints]
        return self._request("POST", "/api/models", kind="models", json=payload).json()

    def delete_models(self) -> None:
        """Remove every registered model endpoint (the gateway has no finer delete)."""
        self._request("DELETE", "/api/models", kind="models")

    def pause(self, retry_after_seconds: int, reason: str | None = None) -> dict[str, Any]:
        body = {"retry_after_seconds": int(retry_after_seconds), "reason": reason}
        return self._request("POST", "/proxy/pause", kind="proxy", json=body).json()

    def proxy_state(self) -> dict[str, Any]:
        return self._request("GET", "/proxy/state", kind="proxy").json()

    def resume(self) -> dict[str, Any]:
        return self._request("POST", "/proxy/resume", kind="proxy").json()

    def healthy(self) -> bool:
        """One unauthenticated ``GET /healthz`` without retries."""
        try:
            return self._http.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False
