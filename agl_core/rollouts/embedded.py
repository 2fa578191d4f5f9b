"""The embedded rollout source: agents run in threads of the trainer, recorded as the gateway records them.

It is the default when no gateway URL is configured (``agentlightning.agl_base_url: null``). Each
rollout runs ``agentlightning.local.agent_class`` (``module:Class``) as ``Class().run()`` — the
controller's contract — in a thread pool, with the contract's environment: ``AGL_OPENAI_BASE_URL``
(``…/proxy/rollout/{rid}/attempt/{aid}/mode/{train|val}/openai/v1``), ``AGL_EVENT_URL``
(``…/api/rollouts/{rid}/attempt/{aid}/events``), ``AGL_KEY`` and the ``local.env_map`` fields of the
rollout input. Those URLs point at a small local server with the gateway's routes: the proxy
forwards each model call to the inference engine (forcing ``return_token_ids``, the mode's
temperature — ``actor_rollout_ref.rollout.temperature`` in train mode,
``actor_rollout_ref.rollout.val_kwargs.temperature`` in val mode, 0 being greedy — and, in train
mode, ``actor_rollout_ref.rollout.top_p`` and ``logprobs``, as the gateway does with its
``default_proxy.{train,val}.temperature``) and records a ``model_request``
event of the gateway's shape; agents post ``reward`` events to the event route. The events are then
parsed by :mod:`agl_core.rollouts.events`, so everything downstream is what the gateway path produces.

A model call that names no ``seed`` is given one, derived from ``trainer.seed``, the step, the
rollout's place in the batch and the call's place in the rollout. Thread scheduling then cannot
change what is sampled, so a seeded run repeats (up to the float noise of batching different prompts
together).

Environment variables are per process, but agents here share one. While the source is open,
``os.environ`` is replaced by a mapping that shows each agent thread its own contract variables over
the real environment (other threads see the real one), so agent code that reads ``os.environ``
runs unchanged.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import httpx
import numpy as np

from agl_core.config import ConfigError
from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.datasets import env_from_map
from agl_core.plugins.event_writer import EventWriter, PendingEvent
from agl_core.rollouts.events import apply_failed_policy, completed_rollout, events_by_attempt, timing_metrics
from agl_core.local_http import JSONRequestHandler, LocalHTTPServer
from agl_core.rollouts.source import RolloutBatch, make_requests, rollout_config

logger = logging.getLogger(__name__)

ATTEMPT_ID = "0"
PROXY_ROUTE = re.compile(r"^/proxy/rollout/([^/]+)/attempt/([^/]+)/mode/([^/]+)/openai/v1/(chat/completions|completions)$")
EVENTS_ROUTE = re.compile(r"^/api/rollouts/([^/]+)(?:/attempt/([^/]+))?/events$")


# -- per-thread environment ----------------------------------------------------------------------


class ThreadEnviron(MutableMapping[str, str]):
    """``os.environ`` with a per-thread overlay: a thread inside :meth:`overlay` sees its own values."""

    def __init__(self, base: MutableMapping[str, str]):
        self.base = base
        self._local = threading.local()

    def _overlay(self) -> Mapping[str, str]:
        return getattr(self._local, "values", None) or {}

    def overlay(self, values: Mapping[str, str]) -> _Overlay:
        return _Overlay(self, values)

    def __getitem__(self, key: str) -> str:
        overlay = self._overlay()
        return overlay[key] if key in overlay else self.base[key]

    def __setitem__(self, key: str, value: str) -> None:
        self.base[key] = value

    def __delitem__(self, key: str) -> None:
        del self.base[key]

    def __iter__(self) -> Iterator[str]:
        overlay = self._overlay()
        yield from overlay
        yield from (k for k in self.base if k not in overlay)

    def __len__(self) -> int:
        return len(set(self.base) | set(self._overlay()))

    def copy(self) -> dict[str, str]:
        return dict(self)


class _Overlay:
    def __init__(self, environ: ThreadEnviron, values: Mapping[str, str]):
        self.environ, self.values = environ, dict(values)

    def __enter__(self) -> None:
        self.environ._local.values = self.values

    def __exit__(self, *exc: Any) -> None:
        self.environ._local.values = None


_environ_lock = threading.Lock()
_environ_users = 0


def _install_thread_environ() -> ThreadEnviron:
    global _environ_users
    with _environ_lock:
        if not isinstance(os.environ, ThreadEnviron):
            os.environ = ThreadEnviron(os.environ)  # type: ignore[assignment]
        _environ_users += 1
        return os.environ  # type: ignore[return-value]


def _uninstall_thread_environ() -> None:
    global _environ_users
    with _environ_lock:
        _environ_users -= 1
        if _environ_users == 0 and isinstance(os.environ, ThreadEnviron):
            os.environ = os.environ.base  # type: ignore[assignment]


def load_agent_class(path: str | None) -> type:
    """``module:Class`` (or ``module.Class``), imported from the working directory as the controller does."""
    key = "agentlightning.local.agent_class"
    if not path:
        raise ConfigError(key, "the embedded rollout source needs the agent class to run (module:Class)")
    module_name, _, class_name = path.partition(":") if ":" in path else path.rpartition(".")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        loaded = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(key, f"cannot import {path!r}: {exc}") from exc
    if not isinstance(loaded, type) or not callable(getattr(loaded, "run", None)):
        raise ConfigError(key, f"{path!r} must be a class with a run() method")
    return loaded


# -- the gateway-shaped local server ---------------------------------------------------------------


class _Recorder:
    """The events of open rollouts, and the forwarding of model calls to the engine."""

    def __init__(
        self, key: str, upstream: str, model_name: str, temperature: Mapping[str, float], max_connections: int, seed: int, top_p: float = 1.0
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
        # At most one call per agent thread is in flight, so no request waits for a connection, and none
        # is trimmed: httpcore 1.0 can close a connection it has just handed to another thread when it
        # drops surplus or expired keep-alive connections (encode/httpcore#1110).
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=None
        )
        self.client = httpx.Client(timeout=None, limits=limits)

    def record(self, rollout_id: str, attempt_id: str, event_type: str, data: dict[str, Any]) -> bool:
        with self.lock:
            events = self.events.get(rollout_id)
            if events is None:
                return False
            events.append(
                {
                    "event_type": event_type,
                    "rollout_id": rollout_id,
                    "attempt_id": attempt_id,
                    "timestamp": time.time(),
                    "data": data,
                }
            )
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
        try:
            response = self.client.post(f"{endpoint.rstrip('/')}/{path}", json=prepared)
        except httpx.HTTPError as exc:
            with self.lock:
                self.counts["training/embedded/n_upstream_errors"] += 1
            logger.warning("model call of rollout %s failed to reach the engine: %s", rollout_id, exc)
            return 502, {"detail": "Upstream model server request failed"}
        try:
            payload = response.json()
        except ValueError:
            payload = {}
        choices = payload.get("choices") if isinstance(payload, dict) else None
        finish = choices[0].get("finish_reason") if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
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


def _handler_for(recorder: _Recorder) -> type[JSONRequestHandler]:
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


# -- the rollout source ---------------------------------------------------------------------------


class EmbeddedRolloutSource:
    """A :class:`~agl_core.rollouts.source.RolloutSource` running agents in-process against ``engine_url``
    (the inference engine's OpenAI base URL) serving ``model_name``."""

    def __init__(self, config: Any, plugins: Any, engine_url: str, model_name: str):
        agl = config.agentlightning
        self.plugins = plugins
        self.agent_class = load_agent_class(agl.local.agent_class)
        self.rollout_config = rollout_config(config)
        self.env_map = dict(agl.local.env_map)
        self.n = int(config.actor_rollout_ref.rollout.n)
        self.reward_fillna_value = float(agl.reward_fillna_value)
        self.failed_rollout_policy = agl.failed_rollout_policy
        self.deadline_seconds = float(agl.rollout_timeout_seconds) + float(agl.rollout_timeout_grace_seconds)
        workers = int(agl.embedded.max_workers)
        self.recorder = _Recorder(
            key=agl.agl_key or secrets.token_hex(16),
            upstream=engine_url,
            model_name=model_name,
            temperature={
                "train": float(config.actor_rollout_ref.rollout.temperature),
                "val": float(config.actor_rollout_ref.rollout.val_kwargs.temperature),
            },
            max_connections=workers,
            seed=int(config.trainer.seed),
            top_p=float(config.actor_rollout_ref.rollout.top_p),
        )
        self.server = LocalHTTPServer(("127.0.0.1", 0), _handler_for(self.recorder))
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._serve = threading.Thread(target=self.server.serve_forever, name="embedded-gateway", daemon=True)
        self._serve.start()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agl-agent")
        self.environ = _install_thread_environ()
        self._closed = False

    def agent_env(self, request: RolloutRequest) -> dict[str, str]:
        """The controller's environment for one rollout."""
        mode = "train" if request.is_train else "val"
        rid = request.rollout_id
        return {
            "AGL_KEY": self.recorder.key,
            "AGL_OPENAI_BASE_URL": f"{self.base_url}/proxy/rollout/{rid}/attempt/{ATTEMPT_ID}/mode/{mode}/openai/v1",
            "AGL_EVENT_URL": f"{self.base_url}/api/rollouts/{rid}/attempt/{ATTEMPT_ID}/events",
            **env_from_map(request.input, self.env_map),
        }

    def _run_agent(self, env: Mapping[str, str]) -> None:
        with self.environ.overlay(env):
            result = self.agent_class().run()
            if inspect.isawaitable(result):
                asyncio.run(result)  # type: ignore[arg-type]

    def collect(self, samples: Sequence[Mapping[str, Any]], *, step: int, is_train: bool) -> RolloutBatch:
        groups = make_requests(
            samples, n=self.n, step=step, is_train=is_train, rollout_config=self.rollout_config, plugins=self.plugins
        )
        requests = [r for group in groups for r in group]
        counts: Counter[str] = Counter()
        queued_at = time.time()
        futures: dict[str, Future[None]] = {}
        errors: dict[str, str] = {}
        for index, request in enumerate(requests):
            try:
                env = self.agent_env(request)
            except KeyError as exc:
                errors[request.rollout_id] = f"local subprocess spawn failed: {exc.args[0]}"
                continue
            self.recorder.open(request.rollout_id, (step, int(is_train), index))
            futures[request.rollout_id] = self.pool.submit(self._run_agent, env)
        _, not_done = wait_futures(futures.values(), timeout=self.deadline_seconds)
        rollouts = []
        for request in requests:
            rid = request.rollout_id
            future = futures.get(rid)
            events = self.recorder.close(rid)
            if future is None:
                state, error = "failed", errors[rid]
            elif future in not_done:
                future.cancel()
                counts["training/rollouts/n_timed_out"] += 1
                state, error = "failed", f"no result within {self.deadline_seconds:.0f} s (rollout timeout + grace)"
            elif future.exception() is not None:
                exc = future.exception()
                state, error = "failed", f"agent raised {type(exc).__name__}: {exc}"
                logger.warning("rollout %s failed: %s", rid, error)
            else:
                state, error = "succeeded", None
            rollout = self._finish(request, events, state, error, queued_at, counts)
            counts[f"training/rollouts/n_{rollout.state}"] += 1
            kept, policy_counts = apply_failed_policy([rollout], self.failed_rollout_policy, self.reward_fillna_value)
            counts.update(policy_counts)
            rollouts.extend(kept)
        with self.recorder.lock:
            counts.update(self.recorder.counts)
            self.recorder.counts.clear()
        metrics = {k: float(v) for k, v in counts.items()}
        metrics.update(timing_metrics(rollouts))
        metrics.update(self.plugins.pop_metrics())
        return RolloutBatch(rollouts, metrics)

    def _finish(
        self, request: RolloutRequest, events: list[dict[str, Any]], state: str, error: str | None, queued_at: float, counts: Counter[str]
    ) -> CompletedRollout:
        """Parse, run the lifecycle hooks, append what they wrote and parse again if they wrote anything."""

        def build(count: bool) -> CompletedRollout:
            rollout, parsed_counts = completed_rollout(
                request,
                events,
                state=state,
                reward_fillna_value=self.reward_fillna_value,
                error=error,
                attempt_id=ATTEMPT_ID,
                queued_at=queued_at,
                ended_at=time.time(),
            )
            if count:
                counts.update(parsed_counts)
            return rollout

        rollout = build(count=True)
        writer = EventWriter()
        if state == "succeeded":
            self.plugins.on_succeeded(rollout, events_by_attempt(events, ATTEMPT_ID), writer)
        else:
            self.plugins.on_failed(rollout, writer)

        def append(event: PendingEvent) -> None:
            events.append(
                {
                    "event_type": event.event_type,
                    "rollout_id": event.rollout_id,
                    "attempt_id": event.attempt_id,
                    "timestamp": time.time(),
                    "data": event.data,
                }
            )

        written = writer.flush(append)
        counts["training/hooks/n_events_written"] += written
        return build(count=False) if written else rollout

    def before_weight_update(self) -> dict[str, float]:
        return {}  # collect() returns only once every agent is done: nothing is in flight

    def after_weight_update(self, endpoints: Sequence[str], version: int) -> None:
        """Route later model calls to ``endpoints[0]`` and record them with ``version``."""
        self.recorder.upstream = endpoints[0]
        self.recorder.version = int(version)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.server.shutdown()
        self.server.server_close()
        self.recorder.client.close()
        _uninstall_thread_environ()
