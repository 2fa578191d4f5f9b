"""The async gateway source's staleness bound (verl V1's ``trainer.v1.sampler.max_off_policy_*``)
against a simulated gateway whose rollouts finish when the test says, so every step is deterministic.

Four groups stay in flight (``async_train_batch_size``), a step trains two (``train_batch_size``), one
rollout per group; a group submitted at step ``s`` spans ``g - s + 1`` versions at step ``g``.
"""

from __future__ import annotations

import json

import httpx
import pytest

from agl_core.config import ConfigError, load_config
from agl_core.plugins import PluginManager
from agl_core.rollouts.gateway_async import AsyncGatewayRolloutSource
from agl_core.rollouts.gateway_client import GatewayClient
from tests.helpers.gateway_fixtures import good_call

URL = "http://gateway.invalid"


class _Gateway:
    """The routes a source polls and reads. A rollout is terminal at the first terminal-cursor poll
    after it is created, unless its input's ``q`` is held: then it runs until :meth:`release`
    counts down the polls it has left."""

    def __init__(self):
        self.created: dict[str, dict] = {}  # rollout id -> input
        self.terminal: list[str] = []  # in completion order (the cursor's log)
        self.held: dict[str, int | None] = {}  # q -> polls left (None: held until released)

    def hold(self, *qs: str) -> None:
        self.held.update(dict.fromkeys(qs))

    def release(self, *qs: str, after_polls: int = 0) -> None:
        """``qs`` finish at the poll after ``after_polls`` more polls."""
        self.held.update(dict.fromkeys(qs, after_polls))

    def _advance(self) -> None:
        for q, left in list(self.held.items()):
            if left == 0:
                del self.held[q]
            elif left is not None:
                self.held[q] = left - 1
        done = set(self.terminal)
        self.terminal += [
            rid for rid, sample in self.created.items() if rid not in done and sample["q"] not in self.held
        ]

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/api/rollouts":
            created = json.loads(request.content)
            self.created.update({item["rollout_id"]: item["input"] for item in created})
            return httpx.Response(201, json=created)
        if path == "/api/rollouts/terminal":
            self._advance()
            after = int(request.url.params["after"])
            items = [{"rollout_id": rid, "state": "succeeded"} for rid in self.terminal[after:]]
            total = len(self.terminal)
            return httpx.Response(200, json={"items": items, "next_after": total, "total_terminal": total})
        if request.method == "DELETE":
            return httpx.Response(204)
        rid = path.split("/")[3]
        if path.endswith("/events"):
            event_type, data = good_call()
            events = [{"event_type": event_type, "data": data}, {"event_type": "reward", "data": {"value": 1.0}}]
            return httpx.Response(200, json=[{**e, "rollout_id": rid, "attempt_id": "0"} for e in events])
        return httpx.Response(404)


def source(gateway: _Gateway, *overrides: str) -> AsyncGatewayRolloutSource:
    config = load_config(
        overrides=[
            f"agentlightning.agl_base_url={URL}",
            "actor_rollout_ref.model.path=policy",
            "agentlightning.async_rollout.enabled=true",
            "agentlightning.async_rollout.async_train_batch_size=4",
            "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "agentlightning.gateway.poll_interval_min_seconds=0.001",
            "agentlightning.gateway.poll_interval_max_seconds=0.001",
            *overrides,
        ]
    )
    client = GatewayClient(URL, transport=httpx.MockTransport(gateway.handle))
    return AsyncGatewayRolloutSource(config, PluginManager(load_entrypoints=False, builtins={}), client)


def trained(batch) -> list[str]:
    return sorted(r.input["q"] for r in batch.rollouts)


def samples(*qs: str) -> list[dict[str, str]]:
    return [{"q": q} for q in qs]


def test_drop_evicts_finished_groups_past_the_threshold_and_tops_up_with_fresh_samples():
    gateway = _Gateway()
    src = source(gateway, "trainer.v1.sampler.max_off_policy_threshold=2")
    src.next_samples = lambda: samples("i", "j")
    gateway.hold("c", "d")
    first = src.collect(samples("a", "b", "c", "d"), step=1, is_train=True)
    assert trained(first) == ["a", "b"]
    assert first.metrics["training/off_policy/evicted_samples"] == 0
    second = src.collect(samples("e", "f"), step=2, is_train=True)
    assert trained(second) == ["e", "f"]  # c and d, from step 1, still run: span 2, within the bound
    assert second.metrics["training/off_policy/evicted_samples"] == 0
    gateway.release("c", "d")
    third = src.collect(samples("g", "h"), step=3, is_train=True)
    # c and d finish at step 3 spanning 3 versions: evicted, and two fresh groups take their places.
    assert trained(third) == ["g", "h"]
    m = third.metrics
    assert m["training/off_policy/evicted_samples"] == 2 and m["training/off_policy/n_evicted_rollouts"] == 2
    assert m["training/off_policy/evicted_samples_staleness/mean"] == 3
    assert (
        m["training/off_policy/evicted_samples_staleness/max"]
        == m["training/off_policy/evicted_samples_staleness/min"]
        == 3
    )
    assert m["training/off_policy/n_refilled_groups"] == 2
    assert m["training/off_policy/trained_staleness/max"] == 1
    fourth = src.collect(samples("k", "l"), step=4, is_train=True)
    assert trained(fourth) == ["i", "j"]  # the refill, oldest first
    src.close()


def test_without_next_samples_the_evicted_groups_are_replaced_at_the_next_steps_top_up():
    gateway = _Gateway()
    src = source(gateway, "trainer.v1.sampler.max_off_policy_threshold=1")
    gateway.hold("c", "d")
    src.collect(samples("a", "b", "c", "d", "x"), step=1, is_train=True)  # x waits in the backlog
    gateway.release("c", "d")
    second = src.collect([], step=2, is_train=True)
    # x tops up one of the two places a and b left; c and d span 2 > 1: evicted, with nothing to
    # replace them, so the step trains the one group left.
    assert trained(second) == ["x"]
    m = second.metrics
    assert m["training/off_policy/evicted_samples"] == 2 and m["training/off_policy/n_refilled_groups"] == 0
    third = src.collect(samples("y", "z"), step=3, is_train=True)
    assert trained(third) == ["y", "z"]
    src.close()


def test_wait_blocks_until_groups_at_the_threshold_finish_and_trains_them_first():
    gateway = _Gateway()
    src = source(
        gateway, "trainer.v1.sampler.max_off_policy_threshold=2", "trainer.v1.sampler.max_off_policy_strategy=wait"
    )
    gateway.hold("c", "d")
    src.collect(samples("a", "b", "c", "d"), step=1, is_train=True)
    gateway.release("c", "d", after_polls=1)  # they finish one poll after e and f
    second = src.collect(samples("e", "f"), step=2, is_train=True)
    # e and f finish first, but c and d have reached the threshold (span 2): the step waits for them,
    # and trains them, oldest first, so no group is ever trained past the bound here.
    assert trained(second) == ["c", "d"]
    m = second.metrics
    assert m["training/off_policy/n_waited_groups"] == 2 and m["training/off_policy/wait_s"] >= 0
    assert m["training/off_policy/trained_staleness/max"] == 2
    assert "training/off_policy/evicted_samples" not in m
    src.close()


def test_drop_with_the_same_finishes_trains_the_fresh_groups_and_evicts_later():
    gateway = _Gateway()
    src = source(gateway, "trainer.v1.sampler.max_off_policy_threshold=2")
    gateway.hold("c", "d")
    src.collect(samples("a", "b", "c", "d"), step=1, is_train=True)
    gateway.release("c", "d", after_polls=1)
    second = src.collect(samples("e", "f"), step=2, is_train=True)
    assert trained(second) == ["e", "f"] and second.metrics["training/off_policy/evicted_samples"] == 0
    src.close()


def test_no_threshold_keeps_agent_lightning_v1s_completion_order_and_reports_no_bound():
    gateway = _Gateway()
    src = source(gateway, "trainer.v1.sampler.max_off_policy_threshold=null")
    gateway.hold("c", "d")
    src.collect(samples("a", "b", "c", "d"), step=1, is_train=True)
    gateway.release("c", "d")
    later = src.collect(samples("e", "f"), step=2, is_train=True)
    assert trained(later) == ["c", "d"]  # finished first (in one poll with e and f, before them in the log)
    m = later.metrics
    assert m["training/off_policy/trained_staleness/max"] == 2
    assert not any(k.startswith("training/off_policy/evicted") or "waited" in k for k in m)
    src.close()


def test_the_validation_batch_is_never_bounded():
    gateway = _Gateway()
    src = source(gateway, "trainer.v1.sampler.max_off_policy_threshold=1")
    batch = src.collect(samples("v0", "v1"), step=9, is_train=False)
    assert trained(batch) == ["v0", "v1"] and not any(k.startswith("training/off_policy") for k in batch.metrics)
    src.close()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.v1.sampler.max_off_policy_threshold=0", "positive integer or null"),
        ("trainer.v1.sampler.max_off_policy_threshold=2.5", "could not be converted to Integer"),
        ("trainer.v1.sampler.max_off_policy_strategy=evict", "one of drop, wait"),
    ],
)
def test_bad_bounds_are_refused_by_name(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(overrides=[override])
    assert info.value.key == override.split("=")[0]


def test_the_defaults_are_verls():
    sampler = load_config().trainer.v1.sampler
    assert (sampler.max_off_policy_threshold, sampler.max_off_policy_strategy) == (8, "drop")
