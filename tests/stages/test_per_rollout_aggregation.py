"""Aggregating each rollout as the source finishes it gives the step exactly what aggregating the
whole batch gives; an aggregator not declared per rollout still gets the whole batch."""

from __future__ import annotations

import json
import random

import attrs
import httpx
import numpy as np
import pytest
import torch

from agl_core.builtins.aggregators import trajectory, transition
from agl_core.config import load_config
from agl_core.data import CompletedRollout, Triplet
from agl_core.hookspecs import hookimpl
from agl_core.plugins import PluginManager
from agl_core.rollouts.gateway_client import GatewayClient
from agl_core.rollouts.gateway_sync import GatewayRolloutSource
from agl_core.stages.aggregation import PerRolloutAggregator
from agl_core.stages.pipeline import PreparedBatch, StepPipeline
from agl_core.stages.tensorize import tensorize
from agl_core.testing.recorded import gateway_trace_rollouts, recorded_steps
from tests.helpers.paths import FIXTURES
from tests.helpers.rollouts import LIMITS, call, rollout

TRACES = FIXTURES / "gateway_traces" / "traces.json"
VOCAB = 1024  # one more than the largest id of the recorded rollouts


class _Tokenizer:
    """The vocabulary's size (turns the vocabulary check on) and a decoder (classifies breaks)."""

    def __len__(self) -> int:
        return VOCAB

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


class _Counted:
    """A per-rollout function that counts its calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, rollout, settings):
        self.calls += 1
        return self.inner(rollout, settings)


class _Aggregators:
    """``counted``: the built-in ``base`` declared per rollout, counting; ``whole_batch``: the same,
    undeclared, recording every batch it gets."""

    def __init__(self, base: PerRolloutAggregator):
        self.counted = _Counted(base.aggregate_rollout)
        self.base = base
        self.batches: list[list[str]] = []

    @hookimpl
    def agl_register_aggregators(self, register):
        register("counted", PerRolloutAggregator(self.counted, trajectory=self.base.trajectory))
        register("whole_batch", self.whole_batch)

    def whole_batch(self, rollouts, settings):
        self.batches.append([r.rollout_id for r in rollouts])
        return self.base(rollouts, settings)


def realistic_batch() -> list[CompletedRollout]:
    """A recorded corridor step (4 groups of 8), the recorded gateway scenarios in one group (a history
    rewrite, a failed rollout trained with a filled reward, a validation rollout, a call without
    log-probs...), a group left with one rollout, a rollout with an out-of-vocabulary call and one
    without any call."""
    rollouts = [*recorded_steps(FIXTURES / "corridor_recording")[3], *gateway_trace_rollouts(TRACES, group_id="traces")]
    return [
        *rollouts,
        CompletedRollout(
            rollout_id="lone",
            group_id="lone-group",
            state="succeeded",
            triplets=[Triplet(prompt_ids=[1, 2], response_ids=[3])],
            final_reward=1.0,
        ),
        CompletedRollout(
            rollout_id="out-of-vocab",
            group_id="traces",
            state="succeeded",
            triplets=[
                Triplet(prompt_ids=[1], response_ids=[2, 3]),
                Triplet(prompt_ids=[1, 2, 3, 9], response_ids=[VOCAB, 4]),
                Triplet(prompt_ids=[5, 6], response_ids=[7]),
            ],
            final_reward=0.5,
        ),
        CompletedRollout(rollout_id="no-calls", group_id="traces", state="failed", final_reward=0.0),
    ]


def config(level: str):
    return load_config(
        overrides=[
            f"agentlightning.trace_aggregator.level={level}",
            "agentlightning.trace_aggregator.mismatch_sample_size=2",  # fewer than the batch's breaks
            "agentlightning.trace_aggregator.trajectory_max_prompt_length=150",  # some rows marked dropped
            "agentlightning.trace_aggregator.trajectory_max_response_length=12",  # some rows truncated
            "data.train_batch_size=6",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        ]
    )


def plugins_with(aggregators: _Aggregators) -> PluginManager:
    manager = PluginManager(load_entrypoints=False)
    manager.register(aggregators)
    return manager


def assert_same_prepared(got: PreparedBatch, expected: PreparedBatch) -> None:
    """Equal metrics (NaN equal to NaN), rows, advantages, returns, scales and tensors."""
    assert got.metrics.keys() == expected.metrics.keys()
    np.testing.assert_array_equal([got.metrics[k] for k in expected.metrics], list(expected.metrics.values()))
    assert got.shaped is not None and expected.shaped is not None
    assert len(got.shaped.rows) == len(expected.shaped.rows)
    for row, other in zip(got.shaped.rows, expected.shaped.rows):
        for name, value in attrs.asdict(row, recurse=False).items():
            if isinstance(value, np.ndarray):
                assert value.dtype == getattr(other, name).dtype and np.array_equal(value, getattr(other, name)), name
            else:
                assert value == getattr(other, name), name
    np.testing.assert_array_equal(got.row_scales, expected.row_scales)
    padded, padded_expected = tensorize(got.shaped.rows), tensorize(expected.shaped.rows)
    assert padded.tensors.keys() == padded_expected.tensors.keys()
    for name, tensor in padded.tensors.items():
        assert torch.equal(tensor, padded_expected.tensors[name]), name
    width = padded.tensors["responses"].shape[1]
    assert torch.equal(got.advantages(width), expected.advantages(width))
    assert torch.equal(got.returns(width), expected.returns(width))


@pytest.mark.parametrize("base", [trajectory, transition], ids=["trajectory", "transition"])
def test_rollouts_aggregated_as_they_finish_give_the_batchs_prepared_batch(base):
    rollouts = realistic_batch()
    aggregators = _Aggregators(base)
    plugins = plugins_with(aggregators)
    whole = StepPipeline(config("whole_batch"), plugins, _Tokenizer()).prepare(rollouts, step=3)
    batch_pipeline = StepPipeline(config("counted"), plugins, _Tokenizer())
    batch = batch_pipeline.prepare(rollouts, step=3)
    assert aggregators.counted.calls == len(rollouts)

    incremental = StepPipeline(config("counted"), plugins, _Tokenizer())
    for finished in random.Random(0).sample(rollouts, len(rollouts)):  # in the order they finish
        incremental.prepare_rollout(finished)
    aggregators.counted.calls = 0
    prepared = incremental.prepare(rollouts, step=3)
    assert aggregators.counted.calls == 1, "only the validation rollout is left to prepare"

    for other in (batch, whole):
        assert_same_prepared(prepared, other)
    samples = incremental.take_samples()
    assert samples["mismatches"] if base is trajectory else "mismatches" not in samples
    assert samples == batch_pipeline.take_samples()
    assert aggregators.batches == [[r.rollout_id for r in rollouts]]
    metrics = prepared.metrics  # the batch really holds each case
    assert metrics["training/events/n_calls_out_of_vocab"] == 1
    assert metrics["training/n_groups_dropped_one_rollout_left"] == 1
    assert metrics["training/n_truncated_sample"] > 0 and metrics["training/n_sample_dropped/marked"] > 0
    if base is trajectory:
        assert metrics["training/n_trace_merge_mismatch_rows"] > 2


def test_a_rollout_seen_early_but_changed_since_is_aggregated_again():
    rollouts = realistic_batch()
    aggregators = _Aggregators(trajectory)
    pipeline = StepPipeline(config("counted"), plugins_with(aggregators), _Tokenizer())
    pipeline.prepare_rollout(attrs.evolve(rollouts[0], final_reward=5.0))  # another object than the one trained
    prepared = pipeline.prepare(rollouts, step=3)
    expected = StepPipeline(config("counted"), plugins_with(_Aggregators(trajectory)), _Tokenizer()).prepare(
        rollouts, step=3
    )
    assert_same_prepared(prepared, expected)


def test_an_undeclared_aggregator_gets_the_whole_batch_once():
    rollouts = realistic_batch()
    aggregators = _Aggregators(trajectory)
    pipeline = StepPipeline(config("whole_batch"), plugins_with(aggregators), _Tokenizer())
    for finished in rollouts:
        pipeline.prepare_rollout(finished)
    assert aggregators.batches == []
    pipeline.prepare(rollouts, step=3)
    assert aggregators.batches == [[r.rollout_id for r in rollouts]]


def test_a_rollout_that_fails_to_aggregate_early_fails_the_step_as_in_the_batch():
    bad = CompletedRollout(
        rollout_id="bad", group_id="g", state="succeeded", triplets=[Triplet(prompt_ids=[1], response_ids=[2])]
    )
    aggregators = _Aggregators(trajectory)
    pipeline = StepPipeline(config("counted"), plugins_with(aggregators), _Tokenizer())
    pipeline.prepare_rollout(bad)  # no final reward: refused, but not here
    with pytest.raises(ValueError, match="final_reward"):
        pipeline.prepare([bad], step=1)


class _Gateway:
    """The routes the sync source uses, answered with the recorded scenarios' events: rollout ``k``
    is scenario ``k`` (validation's left out), and they turn terminal in reverse creation order."""

    def __init__(self):
        stored = json.loads(TRACES.read_text())["scenarios"]
        self.scenarios = [s for name, s in stored.items() if name != "validation_mode"]
        self.created: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST":
            created = json.loads(request.content)
            self.created.extend(item["rollout_id"] for item in created)
            return httpx.Response(201, json=created)
        if path == "/api/rollouts/terminal":
            after = int(request.url.params["after"])
            items = [{"rollout_id": rid, "state": self._record(rid)["status"]["state"]} for rid in self.created[::-1]]
            total = len(items)
            return httpx.Response(200, json={"items": items[after:], "next_after": total, "total_terminal": total})
        rid = path.split("/")[3]
        if request.method == "DELETE":
            return httpx.Response(204)
        if path.endswith("/events"):
            events = self.scenarios[self.created.index(rid)]["events"]
            return httpx.Response(200, json=[{**event, "rollout_id": rid} for event in events])
        return httpx.Response(200, json={"rollout": self._record(rid)})

    def _record(self, rid: str) -> dict:
        return self.scenarios[self.created.index(rid)]["rollout"]["rollout"]


@pytest.mark.parametrize("policy", ["skip", "train"])
def test_the_sync_source_hands_each_kept_rollout_to_the_pipeline_as_it_finishes(policy):
    overrides = [
        "agentlightning.agl_base_url=http://gateway.invalid",
        "actor_rollout_ref.model.path=policy",
        "actor_rollout_ref.rollout.n=2",
        f"agentlightning.failed_rollout_policy={policy}",
        "agentlightning.gateway.poll_interval_min_seconds=0.01",
    ]
    cfg = load_config(overrides=overrides)
    gateway = _Gateway()
    client = GatewayClient("http://gateway.invalid", transport=httpx.MockTransport(gateway.handle))
    source = GatewayRolloutSource(cfg, PluginManager(load_entrypoints=False, builtins={}), client)
    aggregators = _Aggregators(trajectory)
    plugins = plugins_with(aggregators)
    shaping = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]
    step_cfg = load_config(overrides=[*overrides, *shaping, "agentlightning.trace_aggregator.level=counted"])
    pipeline = StepPipeline(step_cfg, plugins)
    handed: list[CompletedRollout] = []

    def done(finished):
        handed.append(finished)
        pipeline.prepare_rollout(finished)

    source.on_rollout_done = done
    try:
        batch = source.collect([{"i": i} for i in range(len(gateway.scenarios) // 2)], step=1, is_train=True)
    finally:
        source.close()
    assert sorted(map(id, handed)) == sorted(map(id, batch.rollouts))  # the very rollouts returned, each once
    assert [r.rollout_id for r in handed] != [r.rollout_id for r in batch.rollouts]  # finished in another order
    assert any(r.state == "failed" for r in batch.rollouts) == (policy == "train")
    prepared = pipeline.prepare(batch.rollouts, step=1)
    assert aggregators.counted.calls == len(batch.rollouts)
    assert_same_prepared(prepared, StepPipeline(step_cfg, plugins).prepare(batch.rollouts, step=1))


def calls_breaking_at(turns):
    """Three calls, each continuing the context except at ``turns``, where the prompt restarts."""
    prompt, calls = [1, 2], []
    for turn in range(3):
        if turn in turns:
            prompt = [9, turn]
        calls.append(call(prompt, [3]))
        prompt = [*prompt, 3, 4]
    return calls


@pytest.mark.parametrize("size", [0, 2, 3, 20])
def test_the_mismatch_sample_is_the_batchs_first_breaks_whichever_rollouts_hold_them(size):
    breaks_at = {"a": [1], "b": [], "c": [1, 2], "d": [2]}
    rollouts = [rollout(*calls_breaking_at(turns), rollout_id=rid) for rid, turns in breaks_at.items()]
    aggregation = trajectory(rollouts, attrs.evolve(LIMITS, mismatch_sample_size=size))
    every = [(rid, turn) for rid, turns in breaks_at.items() for turn in turns]
    assert [(m.rollout_id, m.turn_index) for m in aggregation.mismatches] == every[:size]
    assert aggregation.metrics["training/n_trace_merge_mismatch_rows"] == len(every)
