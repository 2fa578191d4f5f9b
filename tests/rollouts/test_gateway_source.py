"""Sync and async gateway rollout sources against the real ``agl-server`` with a simulated controller."""

from __future__ import annotations

import http.server
import itertools
import threading

import attrs
import httpx
import pytest

from agl_core import hookimpl
from agl_core.config import ConfigError
from agl_core.data import RolloutRequest
from agl_core.rollouts.gateway import gateway_source
from agl_core.rollouts.gateway_async import AsyncGatewayRolloutSource
from agl_core.rollouts.gateway_client import GatewayClient
from agl_core.rollouts.gateway_sync import READ_WORKERS, GatewayRolloutSource
from tests.helpers.gateway_fixtures import (
    Plan,
    SimulatedController,
    always,
    async_config,
    gateway_config,
    good_call,
    list_rollouts,
    plugin_manager,
)
from tests.helpers.gateway_server import MODEL_NAME
from tests.helpers.waiting import PATIENCE_S, wait_until

pytestmark = pytest.mark.gateway


def leftover(server, rollout_ids) -> list[str]:
    """Which of ``rollout_ids`` the gateway still holds (finished rollouts must be deleted)."""
    with GatewayClient(server.url, server.key) as c:
        held = {r["rollout_id"] for r in list_rollouts(c, ["queuing", "running", "succeeded", "failed"], 5000)}
    return sorted(held & set(rollout_ids))


def test_sync_collect_returns_whole_groups_with_the_rollout_config(gateway, tmp_path):
    template = tmp_path / "job.yaml.j2"
    template.write_text("kind: Job  # {{ rollout_id }}\n")
    cfg = gateway_config(
        gateway,
        "agentlightning.local.agent_class=agents:Echo",
        "agentlightning.local.env_map={TASK: input.q}",
        f"agentlightning.k8s.job_template_path={template}",
    )
    enqueued = []

    class Tag:
        @hookimpl
        def agl_on_enqueue(self, request):
            enqueued.append(request.rollout_id)
            return attrs.evolve(request, metadata={"tagged": True})

    rewards = iter([0.1, 0.2, 0.3, 0.4])
    plan = lambda rollout: Plan(delay=0.05, events=(good_call(), ("reward", {"value": next(rewards)})))  # noqa: E731
    source = gateway_source(cfg, plugin_manager(Tag()))
    assert type(source) is GatewayRolloutSource
    with SimulatedController(gateway, plan) as controller:
        batch = source.collect([{"q": "a"}, {"q": "b"}], step=4, is_train=True)
    assert len(batch.rollouts) == 4 and sorted(r.rollout_id for r in batch.rollouts) == sorted(enqueued)
    groups = {r.group_id for r in batch.rollouts}
    assert len(groups) == 2 and all(sum(r.group_id == g for r in batch.rollouts) == 2 for g in groups)
    assert {r.step for r in batch.rollouts} == {4} and all(r.metadata["tagged"] for r in batch.rollouts)
    assert sorted(r.final_reward for r in batch.rollouts) == [0.1, 0.2, 0.3, 0.4]
    rid = batch.rollouts[0].rollout_id
    assert controller.configs[rid] == {
        "timeout_seconds": 30,
        "local": {"agent_class": "agents:Echo", "env_map": {"TASK": "input.q"}},
        "k8s": {"job_template": "kind: Job  # {{ rollout_id }}\n"},
    }
    assert all(n == 1 for n in controller.started.values())
    assert leftover(gateway, enqueued) == []
    m = batch.metrics
    assert m["training/rollouts/n_succeeded"] == 4 and m["training/n_rollouts_w_reward"] == 4
    assert m["timing/rollout_total_s/max"] >= m["timing/rollout_total_s/p50"] > 0
    # Creating in one batch, polling the cursor (as often as the wait lasts), one events read and one
    # delete per rollout, and no per-rollout polling: a read of one rollout only when none progressed
    # for liveness_check_seconds (at most one per such pause).
    sent = source.client.requests_sent
    assert (sent["create"], sent["events"], sent["delete"]) == (1, 4, 4)
    assert sent["get"] <= sent["terminal"] and set(sent) <= {"create", "terminal", "events", "delete", "get"}
    assert m["training/gateway/n_http_requests"] == sum(sent.values())
    source.close()


def test_validation_is_one_rollout_per_sample(gateway):
    source = gateway_source(gateway_config(gateway), plugin_manager())
    with SimulatedController(gateway, always(Plan())):
        batch = source.collect([{"q": 1}, {"q": 2}, {"q": 3}], step=0, is_train=False)
    assert len(batch.rollouts) == 3 and not any(r.is_train for r in batch.rollouts)
    source.close()


def test_missing_job_template_fails_before_any_rollout(gateway, tmp_path):
    cfg = gateway_config(gateway, f"agentlightning.k8s.job_template_path={tmp_path / 'nope.yaml'}")
    with pytest.raises(ConfigError, match="agentlightning.k8s.job_template_path"):
        gateway_source(cfg, plugin_manager())


@pytest.mark.parametrize("policy, expected", [("skip", 0), ("train", 2)])
def test_failed_rollout_policy(gateway, policy, expected):
    failed = []

    class Watch:
        @hookimpl
        def agl_on_failed(self, rollout, writer):
            failed.append(rollout.error)

    cfg = gateway_config(
        gateway, f"agentlightning.failed_rollout_policy={policy}", "agentlightning.reward_fillna_value=-1"
    )
    source = gateway_source(cfg, plugin_manager(Watch()))
    plan = Plan(events=(good_call(), ("reward", {"value": 1.0})), state="failed", error="agent crashed")
    with SimulatedController(gateway, always(plan)):
        batch = source.collect([{"q": 1}], step=0, is_train=True)
    assert len(batch.rollouts) == expected and all(r.final_reward == -1.0 for r in batch.rollouts)
    assert failed == ["agent crashed", "agent crashed"]
    assert batch.metrics["training/rollouts/n_failed"] == 2
    assert batch.metrics[f"training/rollouts/n_failed_{'skipped' if policy == 'skip' else 'trained'}"] == 2
    source.close()


def test_hook_events_are_flushed_and_reread(gateway):
    class Judge:
        @hookimpl
        def agl_on_succeeded(self, rollout, events, writer):
            assert list(events) == ["0"] and events["0"][0]["event_type"] == "model_request"
            assert "request" in events["0"][0]["data"]  # hooks get the events in full
            writer.add_event(rollout.rollout_id, rollout.attempt_id, "reward", {"value": 0.75})

    source = gateway_source(gateway_config(gateway), plugin_manager(Judge()))
    with SimulatedController(gateway, always(Plan(events=(good_call(),)))):
        batch = source.collect([{"q": 1}], step=0, is_train=True)
    assert [r.final_reward for r in batch.rollouts] == [0.75, 0.75]
    assert batch.metrics["training/hooks/n_events_written"] == 2
    # The first read found no reward (counted once, as read); the re-read is not counted twice.
    assert batch.metrics["training/n_rollouts_reward_filled"] == 2
    source.close()


def test_after_weight_update_registers_versioned_endpoints(gateway):
    source = gateway_source(gateway_config(gateway), plugin_manager())
    source.client.register_models(MODEL_NAME, ["http://127.0.0.1:7000/v1"], 0)  # a previous run's engine, gone
    source.after_weight_update(["http://127.0.0.1:7001/v1", "http://127.0.0.1:7002/v1"], 1)
    assert source.client.requests_sent["models"] == 3  # the first registration clears what a previous run left
    source.after_weight_update(["http://127.0.0.1:7001/v1", "http://127.0.0.1:7002/v1"], 2)
    assert source.client.requests_sent["models"] == 4  # same endpoints: upserted, never cleared
    source.after_weight_update(["http://127.0.0.1:7003/v1"], 3)
    assert source.client.requests_sent["models"] == 6  # a stale endpoint: cleared, then registered
    assert source.registered == (["http://127.0.0.1:7003/v1"], 3)
    source.close()


def test_async_keeps_groups_in_flight_and_carries_unfinished_ones_over(gateway):
    slow_done = threading.Event()

    def plan(rollout):
        # Samples "slow*" finish only once the first step has been collected; the rest at once.
        return Plan(release=slow_done) if str(rollout["input"]["q"]).startswith("slow") else Plan()

    source = gateway_source(async_config(gateway), plugin_manager())
    assert type(source) is AsyncGatewayRolloutSource
    with SimulatedController(gateway, plan) as controller:
        first = source.collect([{"q": "slow0"}, {"q": "slow1"}, {"q": "f0"}, {"q": "f1"}], step=0, is_train=True)
        slow_done.set()
        assert {r.input["q"] for r in first.rollouts} == {"f0", "f1"}
        m = first.metrics
        assert m["training/async/n_prev_carry_over_rollouts"] == 0
        assert m["training/async/n_completed_rollouts"] == 4 and m["training/async/n_new_carry_over_rollouts"] == 4
        # Step 1 tops up only the two groups that left; the slow groups keep their step.
        second = source.collect([{"q": "f2"}, {"q": "f3"}, {"q": "f4"}], step=1, is_train=True)
        assert second.metrics["training/async/n_prev_carry_over_rollouts"] == 4
        assert second.metrics["training/async/n_backlog_samples"] == 1
        third = source.collect([], step=2, is_train=True)
    steps = {r.input["q"]: r.step for b in (second, third) for r in b.rollouts}
    assert steps.get("slow0", 0) == 0 and steps.get("slow1", 0) == 0
    returned = [r.rollout_id for b in (first, second, third) for r in b.rollouts]
    assert len(returned) == len(set(returned)) == 12
    assert all(n == 1 for n in controller.started.values())
    source.close()


def test_pause_drain_resume_around_the_weight_update(gateway):
    source = gateway_source(async_config(gateway), plugin_manager())
    metrics = source.before_weight_update()
    assert source.client.proxy_state()["paused"]
    assert metrics["training/async/proxy_inflight_at_pause"] == 0 and metrics["training/async/drain_timed_out"] == 0
    source.after_weight_update(["http://127.0.0.1:7010/v1"], 5)
    assert not source.client.proxy_state()["paused"]
    source.close()


def test_a_run_resumes_a_proxy_an_earlier_run_left_paused(gateway):
    """An async run that ended inside a weight update (killed, a Ray node lost) leaves the proxy
    paused; the next run's first registration resumes it, so its agents' calls are not refused."""
    earlier = gateway_source(async_config(gateway), plugin_manager())
    earlier.before_weight_update()  # and the run ends here, never resuming
    earlier.close()
    source = gateway_source(async_config(gateway), plugin_manager())
    source.after_weight_update(["http://127.0.0.1:7010/v1"], 3)
    assert not source.client.proxy_state()["paused"]
    assert source.counts["training/gateway/n_pauses_cleared"] == 1
    source.after_weight_update(["http://127.0.0.1:7010/v1"], 4)  # only a run's first registration looks
    assert source.counts["training/gateway/n_pauses_cleared"] == 1
    source.close()


def test_drain_is_bounded_while_calls_stay_in_flight(gateway):
    """A model call that does not return keeps the proxy's in-flight count up: the drain gives up
    at its deadline, while the call is still in flight."""
    answer = threading.Event()  # the upstream answers only once the drain has given up

    class Hang(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            answer.wait(PATIENCE_S)
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hang)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    cfg = async_config(gateway, "agentlightning.gateway.drain_timeout_seconds=0.5")
    source = gateway_source(cfg, plugin_manager())
    source.after_weight_update([f"http://127.0.0.1:{upstream.server_port}/v1"], 1)
    source.client.create_rollouts([RolloutRequest(rollout_id="drain", group_id="g", input={})])
    url = f"{gateway.url}/proxy/rollout/drain/attempt/0/mode/train/openai/v1/chat/completions"

    def model_call():
        try:
            body = {"model": MODEL_NAME, "messages": []}
            httpx.post(url, json=body, headers={"x-api-key": gateway.key}, timeout=None)
        except httpx.HTTPError:
            pass  # only its time in flight matters here

    call = threading.Thread(target=model_call, daemon=True)
    call.start()
    wait_until(lambda: source.client.proxy_state()["inflight"] == 1, "the model call in flight at the proxy")
    metrics = source.before_weight_update()  # a drain without a deadline would wait as long as the call
    assert metrics["training/async/proxy_inflight_at_pause"] == 1 and metrics["training/async/drain_timed_out"] == 1
    answer.set()
    source.after_weight_update([f"http://127.0.0.1:{upstream.server_port}/v1"], 2)
    call.join(PATIENCE_S)
    source.client.delete_models()
    source.client.delete_rollout("drain")
    upstream.shutdown()
    source.close()


def test_reads_stay_a_few_rollouts_ahead_of_the_one_being_finished(gateway, monkeypatch):
    """Rollouts that finish together are read concurrently, but never more than READ_WORKERS ahead
    of the rollout being parsed, so a step holds a few decoded bodies, not its batch's."""
    log: list[str] = []
    reads = itertools.count()
    second_read = threading.Event()
    cfg = gateway_config(gateway, "actor_rollout_ref.rollout.n=4", "agentlightning.rollout_timeout_seconds=600")
    source = gateway_source(cfg, plugin_manager())
    read, finish, page = source._read_terminal, source._finish, source.client.terminal_page

    def reading(rid, state):
        n = next(reads)
        log.append("read")
        if n == 1:
            second_read.set()
        elif n == 0:
            second_read.wait(PATIENCE_S)  # returns once a second read runs beside it: reads run concurrently
        return read(rid, state)

    monkeypatch.setattr(source, "_read_terminal", reading)
    monkeypatch.setattr(source, "_finish", lambda *args, **kwargs: (log.append("finish"), finish(*args, **kwargs))[1])
    with SimulatedController(gateway, always(Plan())) as controller:

        def after_all_finished(*args, **kwargs):  # the first poll finds all 32 terminal together
            wait_until(lambda: len(controller.finished_at) == 32, "the controller finishing the 32 rollouts")
            return page(*args, **kwargs)

        monkeypatch.setattr(source.client, "terminal_page", after_all_finished)
        batch = source.collect([{"q": i} for i in range(8)], step=0, is_train=True)
    assert len(batch.rollouts) == 32 and log.count("read") == 32
    finishes = [at for at, entry in enumerate(log) if entry == "finish"]
    ahead = [log[:at].count("read") - finished for finished, at in enumerate(finishes)]
    assert max(ahead) <= 1 + READ_WORKERS  # the one being finished and those read ahead of it
    assert max(ahead) > 1  # and they were read concurrently
    source.close()


def test_each_batch_reports_the_sources_throughput_and_pickup_latency(gateway):
    source = gateway_source(gateway_config(gateway), plugin_manager())
    with SimulatedController(gateway, always(Plan())):
        first = source.collect([{"q": 1}, {"q": 2}], step=0, is_train=True)
        second = source.collect([{"q": 3}], step=1, is_train=True)
    for batch, rollouts in ((first, 4), (second, 2)):
        m = batch.metrics
        rate, interval = m["timing/rollout_source/rollouts_per_s"], m["timing/rollout_source/interval_s"]
        assert interval > 0 and rate * interval == pytest.approx(rollouts)  # every rollout of the step, once
        summary = [m[f"timing/rollout_source/pickup_s/{s}"] for s in ("p50", "p90", "max")]
        assert 0 <= summary[0] <= summary[1] <= summary[2]  # one pickup per rollout read
    source.close()
