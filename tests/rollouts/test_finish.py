"""Finishing a rollout: hooks see the parsed rollout, what they write is stored, and the events are
parsed again only when something was stored and can be read back."""

from __future__ import annotations

from collections import Counter

from agl_core import hookimpl
from agl_core.data import RolloutRequest
from agl_core.plugins import EventWriter, PluginManager
from agl_core.rollouts.finish import finish_rollout, last_attempt_id

REQUEST = RolloutRequest(rollout_id="r1", group_id="g", input={"q": 1})


def call(attempt_id: str = "0") -> dict:
    choice = {"token_ids": [4, 5], "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}
    data = {"response": {"choices": [choice], "prompt_token_ids": [1, 2, 3]}, "http_status": 200, "status": "ok"}
    return {"event_type": "model_request", "attempt_id": attempt_id, "timestamp": 10.0, "data": data}


class Judge:
    """Writes a reward for a succeeded rollout and a note for a failed one."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    @hookimpl
    def agl_on_succeeded(self, rollout, events, writer):
        self.seen.append(("succeeded", sorted(events)))
        writer.add_event(rollout.rollout_id, rollout.attempt_id, "reward", {"value": 0.75})

    @hookimpl
    def agl_on_failed(self, rollout, writer):
        self.seen.append(("failed", rollout.error))
        writer.add_event(rollout.rollout_id, "0", "note", {"why": rollout.error})


def manager(*plugins) -> PluginManager:
    pm = PluginManager(load_entrypoints=False, builtins={})
    for plugin in plugins:
        pm.register(plugin)
    return pm


def finish(events, *, plugins, store, reread, state="succeeded", error=None, attempt_id=None, counts=None):
    return finish_rollout(
        REQUEST,
        events,
        state=state,
        error=error,
        queued_at=1.0,
        attempt_id=attempt_id,
        reward_fillna_value=-1.0,
        plugins=plugins,
        store=store,
        reread=reread,
        counts=counts if counts is not None else Counter(),
    )


def keep_in(events: list):
    def store(writer: EventWriter) -> int:
        return writer.flush(
            lambda e: events.append({"event_type": e.event_type, "attempt_id": e.attempt_id, "data": e.data})
        )

    return store


def test_written_reward_is_stored_and_reparsed_without_counting_twice():
    events, counts, judge = [call("a1"), call("a2")], Counter(), Judge()
    rollout = finish(events, plugins=manager(judge), store=keep_in(events), reread=lambda: events, counts=counts)
    assert judge.seen == [("succeeded", ["a1", "a2"])]
    assert rollout.final_reward == 0.75 and rollout.attempt_id == "a2" and len(rollout.triplets) == 2
    assert events[-1]["event_type"] == "reward"
    assert counts["training/hooks/n_events_written"] == 1
    assert counts["training/events/n_calls"] == 2 and counts["training/n_rollouts_reward_filled"] == 1
    assert counts["training/n_rollouts_w_reward"] == 0


def test_unreadable_or_unasked_reread_keeps_the_first_parse():
    for reread in (lambda: None, None):
        events = [call()]
        rollout = finish(events, plugins=manager(Judge()), store=keep_in(events), reread=reread)
        assert rollout.final_reward == -1.0 and len(events) == 2


def test_failed_rollout_runs_on_failed_and_a_dropping_store_writes_nothing():
    judge, counts = Judge(), Counter()
    dropped = []

    def drop(writer: EventWriter) -> int:
        dropped.append(writer.discard())
        return 0

    rollout = finish(
        [], plugins=manager(judge), store=drop, reread=None, state="failed", error="boom", attempt_id="0", counts=counts
    )
    assert judge.seen == [("failed", "boom")] and dropped == [1]
    assert rollout.state == "failed" and rollout.error == "boom" and rollout.attempt_id == "0"
    assert counts["training/hooks/n_events_written"] == 0


def test_nothing_written_means_no_reread():
    calls = []
    rollout = finish([call()], plugins=manager(), store=keep_in([]), reread=lambda: calls.append(1))
    assert calls == [] and rollout.attempt_id == "0"


def test_last_attempt_id():
    assert last_attempt_id([call("a"), {"event_type": "x"}, call("b"), "junk"]) == "b"
    assert last_attempt_id([]) is None
