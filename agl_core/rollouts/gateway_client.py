"""A synchronous HTTP client for the Agent Lightning gateway (``agl-server`` 1.0.x).

Every call has a timeout. Idempotent calls (reads, deletes, model registration, pause/resume and
rollout creation, which is idempotent because rollout ids are chosen here) are retried with jittered
exponential backoff on timeouts, connection errors and 408/429/5xx answers. Appending an event is
not idempotent: it is retried only when the server provably did not apply it (the connection was
refused, or it answered 408/429/503); an ambiguous failure raises a :class:`GatewayError` with
``ambiguous=True`` so the caller can check before re-sending. Any other 4xx raises at once.

The key is sent as a bearer token and never appears in an error, a log line or ``repr``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx

from agl_core.data import RolloutRequest, thaw

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429}) | frozenset(range(500, 600))
NOT_APPLIED_STATUS = frozenset({408, 429, 503})


class GatewayError(Exception):
    """A gateway call failed for good.

    ``status`` is the HTTP status (``None`` when no answer came: timeout, connection error),
    ``endpoint`` the method and path, ``message`` the server's ``detail`` or the transport error.
    ``ambiguous`` is true when the request may have been applied although no answer confirmed it.
    """

    def __init__(self, endpoint: str, status: int | None, message: str, *, ambiguous: bool = False):
        self.endpoint = endpoint
        self.status = status
        self.message = message
        self.ambiguous = ambiguous
        answer = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"gateway {endpoint}: {answer}: {message}")

    @property
    def not_found(self) -> bool:
        return self.status == 404


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
        timeout_seconds: float = 30.0,
        max_retries: int = 5,
        backoff_seconds: float = 0.5,
        backoff_max_seconds: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout_seconds, transport=transport
        )
        self.max_retries = max_retries
        self.backoff_seconds = backoff_seconds
        self.backoff_max_seconds = backoff_max_seconds
        self.requests_sent: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()
        self._count_lock = threading.Lock()  # the client is shared by reader threads

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> GatewayClient:
        agl = config.agentlightning
        gateway = agl.gateway
        return cls(
            agl.agl_base_url,
            agl.agl_key or "",
            timeout_seconds=gateway.http_timeout_seconds,
            max_retries=gateway.max_retries,
            backoff_seconds=gateway.retry_backoff_seconds,
            backoff_max_seconds=gateway.retry_backoff_max_seconds,
            **kwargs,
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

    def backoff(self, attempt: int) -> float:
        """The jittered wait before retry number ``attempt + 1``."""
        return min(self.backoff_max_seconds, self.backoff_seconds * 2**attempt) * random.uniform(0.5, 1.0)

    def _request(
        self, method: str, path: str, *, kind: str, idempotent: bool = True, **kwargs: Any
    ) -> httpx.Response:
        """Send with retries; return a successful response or raise :class:`GatewayError`."""
        endpoint = f"{method} {path}"
        attempt = 0
        while True:
            with self._count_lock:
                self.requests_sent[kind] += 1
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                provably_unsent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))
                retry, error = idempotent or provably_unsent, GatewayError(
                    endpoint, None, f"{type(exc).__name__}: {exc}", ambiguous=not provably_unsent
                )
            else:
                if response.status_code < 400:
                    return response
                retryable = RETRYABLE_STATUS if idempotent else NOT_APPLIED_STATUS
                retry = response.status_code in retryable
                error = GatewayError(endpoint, response.status_code, _server_message(response))
            if not retry or attempt >= self.max_retries:
                raise error
            delay = self.backoff(attempt)
            attempt += 1
            with self._count_lock:
                self.retries[kind] += 1
            logger.warning("%s; retry %d/%d in %.2fs", error, attempt, self.max_retries, delay)
            time.sleep(delay)

    # -- rollouts -----------------------------------------------------------------------------

    def create_rollouts(self, requests: Sequence[RolloutRequest]) -> list[dict[str, Any]]:
        """Create rollouts with their own ids in one call (idempotent: known ids are left untouched)."""
        if not requests:
            return []
        payload = [rollout_payload(r) for r in requests]
        created = self._request("POST", "/api/rollouts", kind="create", json=payload).json()
        if len(created) != len(payload) or any(c.get("rollout_id") != p["rollout_id"] for c, p in zip(created, payload)):
            raise GatewayError("POST /api/rollouts", 201, "the gateway answered with other rollouts than those sent")
        return created

    def get_rollout(self, rollout_id: str) -> dict[str, Any]:
        """``{"rollout": {...}, "attempts": [...]}``; a :class:`GatewayError` with status 404 if unknown."""
        return self._request("GET", f"/api/rollouts/{rollout_id}", kind="get").json()

    def list_rollouts(self, states: Iterable[str], limit: int = 500) -> list[dict[str, Any]]:
        params = [("state_in", s) for s in states] + [("limit", str(limit))]
        return self._request("GET", "/api/rollouts", kind="list", params=params).json()

    def terminal_page(self, after: int, limit: int = 1000) -> dict[str, Any]:
        """Rollouts that became terminal after cursor ``after``, in completion order."""
        params = {"after": after, "limit": limit}
        return self._request("GET", "/api/rollouts/terminal", kind="terminal", params=params).json()

    def delete_rollout(self, rollout_id: str) -> None:
        self._request("DELETE", f"/api/rollouts/{rollout_id}", kind="delete")

    def patch_rollout(self, rollout_id: str, **status: Any) -> dict[str, Any]:
        """Move a rollout (what a controller does); 409 on an illegal transition."""
        return self._request(
            "PATCH", f"/api/rollouts/{rollout_id}", kind="patch", idempotent=False, json={"status": status}
        ).json()

    # -- events -------------------------------------------------------------------------------

    def get_events(self, rollout_id: str, *, event_type: str | None = None, triplet: bool = False) -> list[dict[str, Any]]:
        """The last attempt's events, raw (default) or in the gateway's ``format=triplet`` view."""
        params = {"include_routed_experts": "false"}
        if event_type is not None:
            params["event_type"] = event_type
        if triplet:
            params["format"] = "triplet"
        return self._request("GET", f"/api/rollouts/{rollout_id}/events", kind="events", params=params).json()

    def append_event(self, rollout_id: str, attempt_id: str, event_type: str, data: Mapping[str, Any]) -> dict[str, Any]:
        path = f"/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"
        body = {"event_type": event_type, "data": thaw(data)}
        return self._request("POST", path, kind="append_event", idempotent=False, json=body).json()

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
