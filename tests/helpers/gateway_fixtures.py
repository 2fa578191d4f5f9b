"""Fixtures for tests against the real gateway, and a simulated controller that drives rollouts.

The simulated controller does what ``agl-controller`` does over HTTP: it lists queuing rollouts,
PATCHes each to ``running`` (attempt ``"0"``), has its agent post ``model_request``-shaped and
``reward`` events at planned times, then PATCHes the final state. A *plan* decides per rollout what
happens, so tests can stage slow, crashing, never-finishing or garbage-emitting agents.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from agl_core.config import load_config
from agl_core.plugins import PluginManager
from agl_core.rollouts.gateway_client import GatewayClient, GatewayError
from agl_core.rollouts.retry import RetryPolicy
from tests.helpers.gateway_server import MODEL_NAME, GatewayServer


def list_rollouts(client: GatewayClient, states: Iterable[str], limit: int = 500) -> list[dict[str, Any]]:
    """The gateway's rollouts in ``states`` (what a controller reads; the trainer never lists)."""
    params = [("state_in", s) for s in states] + [("limit", str(limit))]
    return client._request("GET", "/api/rollouts", kind="list", params=params).json()


def patch_rollout(client: GatewayClient, rollout_id: str, **status: Any) -> dict[str, Any]:
    """Move a rollout (what a controller does); 409 on an illegal transition."""
    return client._request(
        "PATCH", f"/api/rollouts/{rollout_id}", kind="patch", idempotent=False, json={"status": status}
    ).json()


def model_request_data(prompt_ids: list[Any], response_ids: list[Any], log_probs: list[Any] | None) -> dict[str, Any]:
    """What the gateway's proxy records for a chat call to vLLM (the fields the parser reads)."""
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "x"}, "token_ids": response_ids}
    choice["logprobs"] = None if log_probs is None else {"content": [{"token": "t", "logprob": v} for v in log_probs]}
    return {
        "model": MODEL_NAME,
        "model_version": 1,
        "request": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]},
        "response": {"object": "chat.completion", "choices": [choice], "prompt_token_ids": prompt_ids},
        "server": {"model": MODEL_NAME, "endpoint": "http://127.0.0.1:1/v1", "version": 1},
        "http_status": 200,
        "status": "ok",
        "finish_reason": "stop",
    }


def good_call(seed: int = 0) -> tuple[str, dict[str, Any]]:
    return "model_request", model_request_data([1, 2, 3 + seed], [4, 5], [-0.5, -0.25])


@attrs.frozen
class Plan:
    """What one rollout's agent does: after ``delay`` seconds, and once ``release`` is set when there
    is one, post ``events``, then move to ``state`` (``None``: never finishes).

    A test that needs some rollouts to finish after others holds them with ``release`` rather than a
    longer delay: on a loaded machine a delay can run out before the test has looked."""

    delay: float = 0.05
    events: tuple[tuple[str, dict[str, Any]], ...] = (good_call(), ("reward", {"value": 1.0}))
    state: str | None = "succeeded"
    error: str | None = None
    release: threading.Event | None = attrs.field(default=None, eq=False)


def always(plan: Plan) -> Callable[[dict[str, Any]], Plan]:
    return lambda rollout: plan


class SimulatedController:
    """Runs rollouts on the gateway from a background thread, as the local controller would."""

    def __init__(self, server: GatewayServer, plan: Callable[[dict[str, Any]], Plan], poll_seconds: float = 0.02):
        self.server = server
        self.plan = plan
        self.poll_seconds = poll_seconds
        self.client = GatewayClient(server.url, server.key, timeout_seconds=30.0, retry=RetryPolicy(max_retries=0))
        self.started: Counter[str] = Counter()  # rollout id -> times it was started (must stay 1)
        self.finished_at: dict[str, float] = {}  # rollout id -> wall time of its terminal PATCH
        self.inputs: dict[str, Any] = {}
        self.configs: dict[str, Any] = {}
        self.errors: list[str] = []
        self._queue: list[tuple[float, int, str, Plan]] = []
        self._order = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="simulated-controller", daemon=True)

    def __enter__(self) -> SimulatedController:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._start_queuing()
                self._run_due()
            except GatewayError as exc:  # the gateway may be down on purpose
                self.errors.append(str(exc))
            self._stop.wait(self.poll_seconds)

    def _start_queuing(self) -> None:
        for rollout in list_rollouts(self.client, ["queuing"], limit=5000):
            rid = rollout["rollout_id"]
            plan = self.plan(rollout)
            patch_rollout(self.client, rid, state="running", last_attempt_id="0")
            self.started[rid] += 1
            self.inputs[rid] = rollout["input"]
            self.configs[rid] = rollout["config"]
            heapq.heappush(self._queue, (time.monotonic() + plan.delay, next(self._order), rid, plan))

    def _run_due(self) -> None:
        held = []
        while self._queue and self._queue[0][0] <= time.monotonic():
            due = heapq.heappop(self._queue)
            _, _, rid, plan = due
            if plan.state is None:
                continue
            if plan.release is not None and not plan.release.is_set():
                held.append(due)
                continue
            try:
                for event_type, data in plan.events:
                    self.client.append_event(rid, "0", event_type, data)
                status: dict[str, Any] = {"state": plan.state}
                if plan.error:
                    status["error_message"] = plan.error
                patch_rollout(self.client, rid, **status)
                self.finished_at[rid] = time.time()
            except GatewayError as exc:
                self.errors.append(str(exc))
        for due in held:
            heapq.heappush(self._queue, due)


def gateway_config(server: GatewayServer, *overrides: str):
    """A validated config pointing at ``server``, with short polls and backoffs so fault tests stay
    fast, and an HTTP timeout no loaded machine reaches (a test that needs one to fire stalls the
    request: ``tests.helpers.fault_proxy``)."""
    return load_config(
        overrides=[
            f"agentlightning.agl_base_url={server.url}",
            f"agentlightning.agl_key={server.key}",
            f"actor_rollout_ref.model.path={MODEL_NAME}",
            "actor_rollout_ref.rollout.n=2",
            "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "agentlightning.rollout_timeout_seconds=30",
            "agentlightning.rollout_timeout_grace_seconds=0",
            "agentlightning.gateway.http_timeout_seconds=30",
            "agentlightning.gateway.max_retries=2",
            "agentlightning.gateway.retry_backoff_seconds=0.05",
            "agentlightning.gateway.retry_backoff_max_seconds=0.2",
            "agentlightning.gateway.poll_interval_min_seconds=0.02",
            "agentlightning.gateway.poll_interval_max_seconds=0.2",
            "agentlightning.gateway.liveness_check_seconds=1",
            "agentlightning.gateway.drain_timeout_seconds=2",
            *overrides,
        ]
    )


def async_config(server: GatewayServer, *overrides: str):
    """:func:`gateway_config` with async rollouts on: up to two batches of two groups in flight."""
    return gateway_config(
        server,
        "agentlightning.async_rollout.enabled=true",
        "agentlightning.async_rollout.async_train_batch_size=4",
        "data.train_batch_size=2",
        *overrides,
    )


def plugin_manager(*plugins: Any) -> PluginManager:
    manager = PluginManager(load_entrypoints=False, builtins={})
    for plugin in plugins:
        manager.register(plugin)
    return manager
