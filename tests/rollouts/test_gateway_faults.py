"""Faults against the real gateway: each step completes or fails clearly, no rollout is run twice,
and every anomaly shows in a metric."""

from __future__ import annotations

import threading
import time

import pytest

from agl_core import hookimpl
from agl_core.rollouts.gateway import gateway_source
from agl_core.rollouts.gateway_client import GatewayClient, GatewayError
from agl_core.rollouts.retry import RetryPolicy
from agl_core.rollouts.source import REPLACES_KEY
from agl_core.testing.lifecycle import LifecycleLedger
from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.gateway_fixtures import (
    Plan,
    SimulatedController,
    always,
    gateway_config,
    good_call,
    list_rollouts,
    model_request_data,
    plugin_manager,
)
from tests.helpers.gateway_server import GatewayServer
from tests.helpers.waiting import PATIENCE_S, wait_until

pytestmark = pytest.mark.gateway


class InBackground:
    """``fn()`` running in a thread; :meth:`result` waits for it (bounded) and returns what it returned."""

    def __init__(self, fn):
        self._outcome: dict = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn):
        try:
            self._outcome["value"] = fn()
        except BaseException as exc:  # raised again by result()
            self._outcome["error"] = exc

    def result(self):
        self._thread.join(PATIENCE_S)
        assert not self._thread.is_alive(), f"the collect did not return within {PATIENCE_S:g} s"
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]


@pytest.mark.parametrize("policy", ["reenqueue", "fail"])
def test_gateway_killed_and_restarted_mid_wait(policy):
    with GatewayServer() as server:
        cfg = gateway_config(server, f"agentlightning.gateway.restart_policy={policy}")
        ledger = LifecycleLedger()
        source = gateway_source(cfg, plugin_manager(ledger))
        source.after_weight_update(["http://127.0.0.1:7100/v1"], 3)
        release = threading.Event()
        with SimulatedController(server, always(Plan(release=release))) as controller:
            collect = InBackground(lambda: source.collect([{"q": 1}, {"q": 2}], step=0, is_train=True))
            wait_until(lambda: len(controller.started) == 4, "the controller starting the 4 rollouts")
            server.restart()  # everything the gateway held is gone, while the source waits for it
            release.set()
            batch = collect.result()
        m = batch.metrics
        assert m["training/gateway/n_restarts_detected"] >= 1 and m["training/rollouts/n_lost"] == 4
        assert all(n == 1 for n in controller.started.values())  # nothing was run twice
        if policy == "reenqueue":
            assert m["training/rollouts/n_reenqueued"] == 4 and len(batch.rollouts) == 4
            assert all(r.state == "succeeded" for r in batch.rollouts)
            assert len({r.group_id for r in batch.rollouts}) == 2
        else:
            assert m["training/rollouts/n_failed"] == 4 and batch.rollouts == ()
            assert m["training/rollouts/n_failed_skipped"] == 4
        # The models were registered again on the new gateway.
        assert source.client.requests_sent["models"] >= 2
        source.close()
        # Every rollout whose end the hooks saw, they saw enqueued (a re-created one included), and
        # they count what the trainer counts.
        assert ledger.problems() == []
        seen = ledger.counts()
        assert seen["enqueued"] == m["training/rollouts/n_created"] == (8 if policy == "reenqueue" else 4)
        assert seen["succeeded"] == m.get("training/rollouts/n_succeeded", 0)
        assert seen["failed"] == m.get("training/rollouts/n_failed", 0)
        replaced = [r.metadata.get(REPLACES_KEY) for r in batch.rollouts]
        assert all(replaced) if policy == "reenqueue" else replaced == []


def test_proxy_delays_resets_and_503s(gateway):
    with FaultProxy(gateway.port) as proxy:
        cfg = gateway_config(
            gateway, f"agentlightning.agl_base_url={proxy.url}", "agentlightning.gateway.http_timeout_seconds=10"
        )  # only the stalled request outlasts it
        source = gateway_source(cfg, plugin_manager())
        proxy.inject("503", 1, path_contains="POST /api/rollouts")
        proxy.inject("reset_after", 1, path_contains="POST /api/rollouts")  # created, answer lost: retried
        proxy.inject("503", 3, path_contains="/terminal")
        proxy.inject("stall", 1, path_contains="/terminal")
        proxy.inject("reset", 2, path_contains="/events")
        proxy.inject("503", 1, path_contains="DELETE")
        with SimulatedController(gateway, always(Plan(delay=0.1))) as controller:
            batch = source.collect([{"q": 1}, {"q": 2}], step=0, is_train=True)
        assert len(batch.rollouts) == 4 and all(r.final_reward == 1.0 for r in batch.rollouts)
        assert len(controller.started) == 4 and all(n == 1 for n in controller.started.values())
        assert proxy.applied == {"503": 5, "reset_after": 1, "stall": 1, "reset": 2}
        retries = source.client.retries
        assert retries["create"] == 2 and retries["terminal"] == 3 and retries["events"] == 2
        # Three 503s in a row outlast one poll's retries: the poll fails, is counted, and the next succeeds.
        assert batch.metrics["training/gateway/n_poll_errors"] == 1
        source.close()


def test_gateway_unreachable_until_the_deadline_fails_the_rollouts_clearly():
    with GatewayServer() as server:
        cfg = gateway_config(
            server, "agentlightning.rollout_timeout_seconds=1", "agentlightning.gateway.liveness_check_seconds=30"
        )
        source = gateway_source(cfg, plugin_manager())
        create = source.client.create_rollouts

        def create_then_crash(requests):
            created = create(requests)
            server.kill()  # right after taking the rollouts, before their deadline starts; it never comes back
            return created

        source.client.create_rollouts = create_then_crash
        batch = source.collect([{"q": 1}], step=0, is_train=True)
        m = batch.metrics
        assert batch.rollouts == ()
        assert m["training/rollouts/n_timed_out"] == 2 and m["training/gateway/n_poll_errors"] >= 1
        assert m["training/gateway/n_delete_errors"] == 2 and m["training/gateway/n_event_read_errors"] == 2


def test_agent_that_never_finishes_is_failed_by_the_trainer(gateway):
    errors = []

    class Watch:
        @hookimpl
        def agl_on_failed(self, rollout, writer):
            errors.append(rollout.error)
            writer.add_event(rollout.rollout_id, "0", "note", {"why": "timeout"})

    cfg = gateway_config(
        gateway, "agentlightning.rollout_timeout_seconds=1", "agentlightning.rollout_timeout_grace_seconds=0.3"
    )
    source = gateway_source(cfg, plugin_manager(Watch()))
    with SimulatedController(gateway, always(Plan(state=None))):
        start = time.monotonic()
        batch = InBackground(lambda: source.collect([{"q": 1}], step=0, is_train=True)).result()
    assert time.monotonic() - start >= 1.3  # not before the deadline (timeout + grace); after it, however late
    assert batch.rollouts == () and batch.metrics["training/rollouts/n_timed_out"] == 2
    assert all(e.startswith("trainer-side timeout") for e in errors) and len(errors) == 2
    assert batch.metrics["training/hooks/n_unflushed_events"] == 2  # deleted rollouts cannot take events
    with GatewayClient(gateway.url, gateway.key) as c:
        held = {r["rollout_id"] for r in list_rollouts(c, ["queuing", "running"], 5000)}
    assert not held & set(source.pending)  # timed-out rollouts were deleted from the gateway
    source.close()


def test_agent_that_crashes(gateway):
    cfg = gateway_config(
        gateway, "agentlightning.failed_rollout_policy=train", "agentlightning.reward_fillna_value=-0.5"
    )
    source = gateway_source(cfg, plugin_manager())
    with SimulatedController(gateway, always(Plan(events=(good_call(),), state="failed", error="Traceback: boom"))):
        batch = source.collect([{"q": 1}], step=0, is_train=True)
    assert [r.error for r in batch.rollouts] == ["Traceback: boom"] * 2
    assert all(r.final_reward == -0.5 and len(r.triplets) == 1 for r in batch.rollouts)
    assert batch.metrics["training/rollouts/n_failed_trained"] == 2
    source.close()


def test_garbage_events_are_counted_not_trained(gateway):
    events = (
        ("model_request", model_request_data([1, 2], ["a", "b"], [-0.1, -0.2])),  # garbled ids
        ("model_request", model_request_data(None, [3], [-0.1])),  # missing prompt ids
        ("model_request", model_request_data([1, 2], [3, 4], [-0.1, 0.7])),  # impossible (positive) log-prob
        ("model_request", model_request_data([1, 2], [3, 4], [-0.1, "nan?"])),  # non-numeric log-prob
        ("reward", {"value": 0.4}),
        ("reward", {"value": True}),
        ("reward", {"value": "1.0"}),
    )
    source = gateway_source(gateway_config(gateway), plugin_manager())
    with SimulatedController(gateway, always(Plan(events=events))):
        batch = source.collect([{"q": 1}], step=0, is_train=True)
    m = batch.metrics
    assert m["training/events/n_calls_garbled_token_ids"] == 2 and m["training/events/n_calls_missing_token_ids"] == 2
    assert m["training/events/n_calls_bad_log_probs"] == 4 and m["training/events/n_bad_rewards"] == 4
    for r in batch.rollouts:
        assert r.final_reward == 0.4
        assert len(r.triplets) == 2 and all(t.response_log_probs is None for t in r.triplets)
    source.close()


def test_a_hook_that_raises_is_isolated_and_counted(gateway):
    class Broken:
        @hookimpl
        def agl_on_succeeded(self, rollout, events, writer):
            raise RuntimeError("hook bug")

    class Fine:
        @hookimpl
        def agl_on_succeeded(self, rollout, events, writer):
            writer.add_event(rollout.rollout_id, rollout.attempt_id, "reward", {"value": 0.9})

    source = gateway_source(gateway_config(gateway), plugin_manager(Broken(), Fine()))
    with SimulatedController(gateway, always(Plan(events=(good_call(),)))):
        batch = source.collect([{"q": 1}], step=0, is_train=True)
    assert [r.final_reward for r in batch.rollouts] == [0.9, 0.9]
    assert batch.metrics["training/n_hook_failures/agl_on_succeeded"] == 2
    source.close()


def test_hook_event_flush_survives_an_ambiguous_reset_without_duplicating(gateway):
    with FaultProxy(gateway.port) as proxy:
        cfg = gateway_config(gateway, f"agentlightning.agl_base_url={proxy.url}", "actor_rollout_ref.rollout.n=1")

        class Judge:
            @hookimpl
            def agl_on_succeeded(self, rollout, events, writer):
                writer.add_event(rollout.rollout_id, rollout.attempt_id, "reward", {"value": 0.3})
                writer.add_event(rollout.rollout_id, rollout.attempt_id, "note", {"n": 1})

        source = gateway_source(cfg, plugin_manager(Judge()))
        proxy.inject("reset_after", 1, path_contains="/attempt/0/events")  # applied, answer lost
        proxy.inject("reset", 1, path_contains="/attempt/0/events")  # not applied, answer lost
        with SimulatedController(gateway, always(Plan(events=(good_call(),)))):
            batch = source.collect([{"q": 1}], step=0, is_train=True)
        (rollout,) = batch.rollouts
        assert rollout.final_reward == 0.3
        assert batch.metrics["training/hooks/n_events_written"] == 2
        assert "training/hooks/n_unflushed_events" not in batch.metrics
        # The applied event was found by reading back, not re-sent; the unapplied one was sent again.
        assert source.client.requests_sent["append_event"] == 3 and source.client.retries["append_event"] == 1
        source.close()


@pytest.mark.parametrize("fault", ["503", "reset"])
def test_a_hook_event_takes_at_most_max_retries_plus_one_attempts(gateway, fault):
    """A gateway that never takes the event: one budget of attempts, then the event is dropped and counted."""
    with FaultProxy(gateway.port) as proxy:
        cfg = gateway_config(gateway, f"agentlightning.agl_base_url={proxy.url}", "actor_rollout_ref.rollout.n=1")

        class Judge:
            @hookimpl
            def agl_on_succeeded(self, rollout, events, writer):
                writer.add_event(rollout.rollout_id, rollout.attempt_id, "reward", {"value": 0.3})

        source = gateway_source(cfg, plugin_manager(Judge()))
        proxy.inject(fault, 1000, path_contains="/attempt/0/events")  # every append, never a read
        with SimulatedController(gateway, always(Plan())):
            batch = source.collect([{"q": 1}], step=0, is_train=True)
        attempts = cfg.agentlightning.gateway.max_retries + 1
        assert proxy.applied[fault] == attempts and source.client.requests_sent["append_event"] == attempts
        assert batch.metrics["training/hooks/n_unflushed_events"] == 1
        assert batch.metrics["training/hooks/n_events_written"] == 0
        assert [r.final_reward for r in batch.rollouts] == [1.0]  # the agent's own reward stands
        source.close()


def test_unauthorised_polls_fail_the_step_clearly(gateway):
    cfg = gateway_config(gateway)
    source = gateway_source(cfg, plugin_manager())
    source.client = GatewayClient(gateway.url, "wrong-key", retry=RetryPolicy(max_retries=0))
    with pytest.raises(GatewayError) as err:
        source.collect([{"q": 1}], step=0, is_train=True)
    assert err.value.status == 401 and "wrong-key" not in str(err.value)
