"""The embedded source runs unchanged contract agents in threads and records gateway-shaped events."""

from __future__ import annotations

import json
import os
import threading

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agl_core.config import ConfigError, load_config
from agl_core.files.datasets import env_from_map
from agl_core.plugins import PluginManager
from agl_core.rollouts.agents import ThreadEnviron, load_agent_class
from agl_core.rollouts.embedded import EmbeddedRolloutSource
from agl_core.serving.policy_server import PolicyServer
from tests.helpers.corridor_policy import build_corridor_policy
from tests.helpers.waiting import wait_until


class EnvEchoAgent:
    """Reports its own contract variables as events, proving each thread sees its own."""

    def run(self):
        headers = {"Authorization": f"Bearer {os.environ['AGL_KEY']}"}
        data = {
            "base": os.environ["AGL_OPENAI_BASE_URL"],
            "event": os.environ["AGL_EVENT_URL"],
            "signs": os.getenv("CORRIDOR_SIGNS"),
        }
        httpx.post(
            os.environ["AGL_EVENT_URL"], headers=headers, json={"event_type": "echo", "data": data}
        ).raise_for_status()
        httpx.post(
            os.environ["AGL_EVENT_URL"], headers=headers, json={"event_type": "reward", "data": {"value": 1.0}}
        ).raise_for_status()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = build_corridor_policy(tmp_path_factory.mktemp("policy"))
    torch.set_num_threads(1)
    server = PolicyServer(
        AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), str(folder)
    )
    server.start()
    yield server, folder
    server.close()


def _source(engine, agent, n=2, plugins=(), overrides=()):
    server, folder = engine
    cfg = load_config(
        overrides=[
            f"agentlightning.local.agent_class={agent}",
            f"actor_rollout_ref.rollout.n={n}",
            f"actor_rollout_ref.model.path={folder}",
            *overrides,
        ]
    )
    cfg.agentlightning.local.env_map = {"CORRIDOR_SIGNS": "input.signs"}
    manager = PluginManager.from_config(cfg, plugins, load_entrypoints=False)
    return EmbeddedRolloutSource(cfg, manager, server.base_url, server.model_name)


SAMPLES = [{"signs": ["left", "right", "left"]}, {"signs": ["right", "right", "left"]}]


def test_corridor_agent_rollouts_become_triplets_and_rewards(engine):
    source = _source(engine, "examples.corridor.agent:CorridorAgent", n=3)
    try:
        batch = source.collect(SAMPLES, step=1, is_train=True)
    finally:
        source.close()
    assert len(batch.rollouts) == 6
    assert {r.group_id for r in batch.rollouts}.__len__() == 2
    for rollout in batch.rollouts:
        assert rollout.state == "succeeded"
        assert len(rollout.triplets) == 3  # one per junction
        assert all(t.response_log_probs is not None for t in rollout.triplets)
        assert rollout.final_reward in (0.0, 1 / 3, 2 / 3, 1.0)
    assert batch.metrics["training/events/n_calls"] == 18
    assert batch.metrics["training/n_rollouts_w_reward"] == 6
    assert not isinstance(os.environ, ThreadEnviron)  # restored on close


def _sampled(source, step):
    batch = source.collect(SAMPLES, step=step, is_train=True)
    return [[t.response_ids.tolist() for t in r.triplets] for r in batch.rollouts]


def test_sampling_is_seeded_per_call_so_thread_scheduling_cannot_change_it(engine):
    """One worker (every call alone) and eight (calls batched together) sample the same tokens."""
    agent = "examples.corridor.agent:CorridorAgent"
    alone = _source(engine, agent, n=3, overrides=["agentlightning.embedded.max_workers=1"])
    together = _source(engine, agent, n=3, overrides=["agentlightning.embedded.max_workers=8"])
    reseeded = _source(engine, agent, n=3, overrides=["trainer.seed=1"])
    try:
        first = _sampled(alone, step=4)
        assert _sampled(together, step=4) == first
        assert _sampled(together, step=5) != first
        assert _sampled(reseeded, step=4) != first
    finally:
        for source in (alone, together, reseeded):
            source.close()
    assert len({str(r) for r in first}) > 1  # the rollouts of a group differ: each has its own seeds


def test_each_thread_sees_its_own_contract_environment(engine):
    seen = []

    class Recorder:
        from agl_core import hookimpl

        @hookimpl
        def agl_on_succeeded(self, rollout, events, writer):
            echo = [e for e in events["0"] if e["event_type"] == "echo"][0]["data"]
            seen.append((rollout.rollout_id, json.loads(echo["signs"]), echo))

    source = _source(engine, "tests.rollouts.test_embedded:EnvEchoAgent", n=4, plugins=[Recorder()])
    try:
        batch = source.collect(SAMPLES, step=1, is_train=False)  # validation: one rollout per sample
    finally:
        source.close()
    assert len(seen) == 2
    by_id = {r.rollout_id: r for r in batch.rollouts}
    for rid, signs, echo in seen:
        assert signs == list(by_id[rid].input["signs"])
        assert f"/proxy/rollout/{rid}/attempt/0/mode/val/openai/v1" in echo["base"]
        assert echo["event"].endswith(f"/api/rollouts/{rid}/attempt/0/events")
    assert "AGL_OPENAI_BASE_URL" not in os.environ


def test_a_failing_agent_is_a_failed_rollout_counted(engine):
    source = _source(engine, "tests.helpers.agents:FailingAgent")
    try:
        batch = source.collect(SAMPLES[:1], step=1, is_train=True)
    finally:
        source.close()
    assert batch.rollouts == ()  # failed_rollout_policy: skip
    assert batch.metrics["training/rollouts/n_failed"] == 2


def test_proxy_refuses_a_wrong_key_and_unknown_rollouts(engine):
    source = _source(engine, "examples.corridor.agent:CorridorAgent")
    try:
        url = f"{source.base_url}/proxy/rollout/nope/attempt/0/mode/train/openai/v1/chat/completions"
        assert httpx.post(url, json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert (
            httpx.post(
                url, json={"messages": []}, headers={"Authorization": f"Bearer {source.recorder.key}"}
            ).status_code
            == 404
        )
    finally:
        source.close()


def test_env_map_and_agent_class_errors_name_the_key():
    assert env_from_map({"a": {"b": [1, 2]}}, {"X": "input.a.b.1", "Y": "input.a", "Z": "literal"}) == {
        "X": "2",
        "Y": '{"b": [1, 2]}',
        "Z": "literal",
    }
    with pytest.raises(KeyError, match="env_map.X"):
        env_from_map({"a": 1}, {"X": "input.missing"})
    with pytest.raises(ConfigError, match="agentlightning.local.agent_class"):
        load_agent_class("no_such_module_xyz:Agent")
    with pytest.raises(ConfigError, match="agentlightning.local.agent_class"):
        load_agent_class(None)


@pytest.fixture
def slow_engine(engine, request):
    """The policy server sleeping before every forward pass, i.e. per generated token
    (``request.param`` seconds, 0.25 by default)."""
    server, folder = engine
    forward = server._model.forward
    delay = getattr(request, "param", 0.25)

    def slow_forward(*args, **kwargs):
        FOREVER_SLOW.wait(delay)
        return forward(*args, **kwargs)

    server._model.forward = slow_forward
    yield engine
    server._model.forward = forward


FOREVER_SLOW = threading.Event()  # never set: waiting on it sleeps for the timeout given


def _engine_trouble(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if "Bad file descriptor" in r.getMessage() or "policy server failed" in r.getMessage()
    ]


def test_a_slow_engine_makes_slow_rollouts_that_complete(slow_engine, caplog):
    source = _source(
        slow_engine, "examples.corridor.agent:CorridorAgent", overrides=["agentlightning.rollout_timeout_seconds=60"]
    )
    try:
        batch = source.collect(SAMPLES[:1], step=1, is_train=True)
    finally:
        source.close()
    assert batch.metrics["training/rollouts/n_succeeded"] == 2 and "training/rollouts/n_failed" not in batch.metrics
    assert "training/embedded/n_upstream_errors" not in batch.metrics
    assert batch.metrics["timing/rollout_run_duration_s/max"] > 0.5  # three turns of at least one slow token each
    assert not _engine_trouble(caplog)


class RequestsInFlight:
    """Counts the requests a :class:`PolicyServer` is handling (each in its own thread), so a test
    can wait until every one has been answered, or found its client gone."""

    def __init__(self, server: PolicyServer, monkeypatch):
        self.count = 0
        self._lock = threading.Lock()
        handle = server._httpd.process_request_thread

        def counted(*args):
            with self._lock:
                self.count += 1
            try:
                handle(*args)
            finally:
                with self._lock:
                    self.count -= 1

        monkeypatch.setattr(server._httpd, "process_request_thread", counted)


@pytest.mark.parametrize("slow_engine", [1.5], indirect=True)
def test_an_engine_slower_than_the_timeout_fails_naming_the_key_once_per_cause_and_closes_cleanly(
    slow_engine, caplog, monkeypatch
):
    caplog.set_level("DEBUG", logger="agl_core.local_http")
    in_flight = RequestsInFlight(slow_engine[0], monkeypatch)
    source = _source(
        slow_engine,
        "examples.corridor.agent:CorridorAgent",
        n=3,
        overrides=["agentlightning.rollout_timeout_seconds=1", "agentlightning.rollout_timeout_grace_seconds=0.5"],
    )
    try:
        batch = source.collect(SAMPLES, step=1, is_train=True)
    finally:
        source.close()  # with the engine still generating for the calls given up on
    assert batch.metrics["training/rollouts/n_failed"] == 6
    lines = [r.getMessage() for r in caplog.records if r.name == "agl_core.rollouts.embedded"]
    assert lines and all(line.startswith("step 1: ") for line in lines)
    assert (
        sum(int(line.split()[2]) for line in lines if "rollouts failed" in line) == 6
    )  # every failure, counted by cause
    assert len(lines) == len(set(line.split(":", 2)[2].split(" (first:")[0] for line in lines))  # one line per cause
    timeouts = "agentlightning.rollout_timeout_seconds=1"
    assert all(timeouts in line or "504 Gateway Timeout" in line for line in lines)
    if batch.metrics.get("training/embedded/n_upstream_errors"):
        assert any(
            f"model call(s) got no answer: the engine did not answer within {timeouts} s" in line for line in lines
        )
    wait_until(lambda: in_flight.count == 0, "the abandoned generations finishing and finding their clients gone")
    assert not _engine_trouble(caplog)
