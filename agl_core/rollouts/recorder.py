"""The embedded source's stand-in for the gateway: a small local server with the gateway's routes.

Agents reach it through the contract URLs. The proxy route forwards each model call to the inference
engine (forcing ``return_token_ids``, the mode's temperature and, in train mode, ``logprobs``, as the
gateway does with its ``default_proxy.{train,val}.temperature``) and records a ``model_request``
event of the gateway's shape; the events route takes the agents' ``reward`` (and other) events and
returns a rollout's events in the gateway's raw format. Only open rollouts are served.

A model call waits for the engine as long as its rollout may run (``agentlightning.rollout_timeout_seconds``):
a slow engine makes slow rollouts. A call that outlasts it is answered 504 with an error naming that
key and its value. Every call that fails to get an answer is counted by cause
(:meth:`Recorder.pop_failures`), for the source to log once per cause with its count. When the
source closes, it waits a moment for the calls in flight (those of rollouts already given up on)
before closing the connections to the engine, and what still fails then is not an engine failure.

A model call that names no ``seed`` is given one, derived from ``trainer.seed``, the step, the
rollout's place in the batch and the call's place in the rollout. Thread scheduling then cannot
change what is sampled, so a seeded run repeats (up to the float noise of batching different prompts
together).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import httpx
import numpy as np

from agl_core.local_http import JSONRequestHandler

__all__ = ["EVENTS_ROUTE", "PROXY_ROUTE", "Recorder", "recorded_event", "recorder_handler"]

logger = logging.getLogger(__name__)

PROXY_ROUTE = re.compile(
    r"^/proxy/rollout/([^/]+)/attempt/([^/]+)/mode/([^/]+)/openai/v1/(chat/completions|completions)$"
)
EVENTS_ROUTE = re.compile(r"^/api/rollouts/([^/]+)(?:/attempt/([^/]+))?/events$")


def recorded_event(rollout_id: str, attempt_id: str, event_type: str, data: dict[str, Any]) -> dict[str, Any]:
    """One event as the gateway's raw events route returns it, stamped now."""
    return {
        "event_type": event_type,
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "timestamp": time.time(),
        "data": data,
    }


class Recorder:
    """The events of open rollouts, and the forwarding of model calls to the engine."""

    def __init__(
        self,
        key: str,
        upstream: str,
        model_name: str,
        temperature: Mapping[str, float],
        max_connections: int,
        seed: int,
        top_p: float = 1.0,
        call_timeout_s: float = 1800.0,
    ):
        self.key = key
        self.upstream = upstream
        self.model_name = model_name
        self.version = 0
        self.temperature = dict(temperature)  # by proxy mode: train, val
        self.top_p = top_p  # train mode only (validation samples at the engine's default, 1.0)
        self.seed = seed
        self.events: dict[str, list[dict[str, Any]]] = {}
        self.places: dict[str, tuple[int, int, int]] = {}  # rollout id -> (step, is_train, index in batch)
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()  # cause -> model calls that got no answer from the engine
        self.call_timeout_s = call_timeout_s
        self._in_flight = 0
        self._idle = threading.Condition(self.lock)
        self._closing = False
        # At most one call per agent thread is in flight, so no request waits for a connection, and none
        # is trimmed: httpcore 1.0 can close a connection it has just handed to another thread when it
        # drops surplus or expired keep-alive connections (encode/httpcore#1110).
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=None
        )
        self.client = httpx.Client(timeout=httpx.Timeout(call_timeout_s), limits=limits)

    def record(self, rollout_id: str, attempt_id: str, event_type: str, data: dict[str, Any]) -> bool:
        with self.lock:
            events = self.events.get(rollout_id)
            if events is None:
                return False
            events.append(recorded_event(rollout_id, attempt_id, event_type, data))
            return True

    def is_open(self, rollout_id: str) -> bool:
        with self.lock:
            return rollout_id in self.events

    def open(self, rollout_id: str, place: tuple[int, int, int]) -> None:
        with self.lock:
            self.events[rollout_id] = []
            self.places[rollout_id] = place

    def close(self, rollout_id: str) -> list[dict[str, Any]]:
        with self.lock:
            self.places.pop(rollout_id, None)
            return self.events.pop(rollout_id, [])

    def call_seed(self, rollout_id: str) -> int | None:
        """The seed of the rollout's next model call, or None for a rollout that is not open."""
        with self.lock:
            place = self.places.get(rollout_id)
            if place is None:
                return None
            n_calls = sum(e["event_type"] == "model_request" for e in self.events[rollout_id])
        return int(np.random.SeedSequence([self.seed, *place, n_calls]).generate_state(1)[0])

    def proxy(self, rollout_id: str, attempt_id: str, mode: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        prepared = {**body, "model": self.model_name, "temperature": self.temperature[mode], "return_token_ids": True}
        if prepared.get("seed") is None:
            prepared["seed"] = self.call_seed(rollout_id)
        if mode == "train":
            prepared["logprobs"] = True
            prepared["top_p"] = self.top_p
        if prepared.get("stream"):
            return 400, {"detail": "Streaming responses are not supported"}
        endpoint = self.upstream
        version = self.version
        started = time.perf_counter()
        with self.lock:
            if self._closing:
                return 503, {"detail": "the run is ending; no more model calls are served"}
            self._in_flight += 1
        try:
            response = self.client.post(f"{endpoint.rstrip('/')}/{path}", json=prepared)
        except httpx.HTTPError as exc:
            return self._failed(rollout_id, exc)
        finally:
            with self.lock:
                self._in_flight -= 1
                self._idle.notify_all()
        try:
            payload = response.json()
        except ValueError:
            payload = {}
        choices = payload.get("choices") if isinstance(payload, dict) else None
        finish = (
            choices[0].get("finish_reason")
            if isinstance(choices, list) and choices and isinstance(choices[0], dict)
            else None
        )
        self.record(
            rollout_id,
            attempt_id,
            "model_request",
            {
                "model": self.model_name,
                "model_version": version,
                "request": prepared,
                "response": payload,
                "server": {"model": self.model_name, "endpoint": endpoint, "version": version},
                "latency_ms": (time.perf_counter() - started) * 1000,
                "http_status": response.status_code,
                "status": "ok" if response.status_code < 400 else "error",
                "retry_count": 0,
                "routed_experts": None,
                "usage": payload.get("usage") if isinstance(payload, dict) else None,
                "finish_reason": finish,
            },
        )
        return response.status_code, payload

    def _failed(self, rollout_id: str, exc: httpx.HTTPError) -> tuple[int, Any]:
        """The answer to a model call that got none from the engine, counted by cause (not while closing)."""
        with self.lock:
            closing = self._closing
        if closing:
            logger.debug("model call of rollout %s ended by the source closing: %s", rollout_id, exc)
            return 503, {"detail": "the run is ending; no more model calls are served"}
        if isinstance(exc, httpx.TimeoutException):
            status, cause = (
                504,
                (
                    f"the engine did not answer within "
                    f"agentlightning.rollout_timeout_seconds={self.call_timeout_s:g} s "
                    f"({type(exc).__name__})"
                ),
            )
        else:
            status, cause = 502, f"the engine could not be reached: {type(exc).__name__}: {exc}"
        with self.lock:
            self.counts["training/embedded/n_upstream_errors"] += 1
            self.failures[cause] += 1
        return status, {"detail": cause}

    def pop_failures(self) -> Counter[str]:
        """Model calls that got no answer since the last call, by cause."""
        with self.lock:
            failures, self.failures = self.failures, Counter()
        return failures

    def shutdown(self, wait_s: float) -> None:
        """Refuse new model calls, wait up to ``wait_s`` for those in flight, then close the engine's
        connections (closing them under a call still reading would fail it with EBADF)."""
        deadline = time.monotonic() + wait_s
        with self.lock:
            self._closing = True
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
        self.client.close()


def recorder_handler(recorder: Recorder) -> type[JSONRequestHandler]:
    class Handler(JSONRequestHandler):
        server_label = "embedded gateway"

        def _authorised(self) -> bool:
            auth = self.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else self.headers.get("x-api-key", "")
            return secrets.compare_digest(given.encode(), recorder.key.encode())

        def do_GET(self) -> None:
            if self.path == "/healthz":
                return self.send_json(200, {"status": "ok"})
            if not self._authorised():
                return self.send_json(401, {"detail": "Unauthorized"})
            match = EVENTS_ROUTE.match(self.path.split("?")[0])
            if match is None:
                return self.send_json(404, {"detail": "Not Found"})
            with recorder.lock:
                events = recorder.events.get(match.group(1))
                events = None if events is None else list(events)
            self.send_json(404, {"detail": "Rollout not found"}) if events is None else self.send_json(200, events)

        def do_POST(self) -> None:
            raw = self.read_body()
            if not self._authorised():
                return self.send_json(401, {"detail": "Unauthorized"})
            try:
                body = json.loads(raw) if raw else {}
            except json.JSONDecodeError:
                return self.send_json(400, {"detail": "Invalid JSON in request body"})
            if not isinstance(body, dict):
                return self.send_json(400, {"detail": "Request body must be a JSON object"})
            if match := PROXY_ROUTE.match(self.path):
                rollout_id, attempt_id, mode, path = match.groups()
                if mode not in ("train", "val"):
                    return self.send_json(404, {"detail": f"Unsupported proxy mode: {mode}"})
                if not recorder.is_open(rollout_id):
                    return self.send_json(404, {"detail": f"Rollout not found: {rollout_id}"})
                return self.send_json(*recorder.proxy(rollout_id, attempt_id, mode, path, body))
            if (match := EVENTS_ROUTE.match(self.path)) and match.group(2):
                event_type, data = body.get("event_type"), body.get("data", {})
                if not isinstance(event_type, str) or not event_type or not isinstance(data, dict):
                    return self.send_json(422, {"detail": "an event needs a string event_type and an object data"})
                if not recorder.record(match.group(1), match.group(2), event_type, data):
                    return self.send_json(404, {"detail": f"Rollout not found: {match.group(1)}"})
                return self.send_json(201, {"event_type": event_type, "data": data})
            self.send_json(404, {"detail": "Not Found"})

    return Handler
